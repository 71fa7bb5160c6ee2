"""Whether torch's variable-length flash attention (forward and backward) can be replayed from a CUDA graph
with the row bounds in a static device tensor and max_seqlen an upper bound."""
import json, torch
from torch.nn.attention.varlen import varlen_attn
import inspect
kw = set(inspect.signature(varlen_attn).parameters)
print("varlen keywords", sorted(kw))
torch.manual_seed(0)
dev = "cuda"
H, D, T = 14, 64, 2304
def run(q, k, v, cu, longest):
    extra = {"window_size": (-1, 0)} if "window_size" in kw else {"is_causal": True}
    return varlen_attn(q, k, v, cu, cu, longest, longest, **extra)
def bounds(lengths):
    ends = torch.tensor([0] + lengths).cumsum(0)
    return torch.cat([ends, torch.tensor([T])]).to(torch.int32).to(dev)
q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
cu = bounds([300, 200, 500, 100, 250, 400, 120, 330])
results = {}
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    out = run(q, k, v, cu, T); out.backward(g)
torch.cuda.current_stream().wait_stream(s)
q.grad = k.grad = v.grad = None
graph = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(graph):
        out = run(q, k, v, cu, T)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    results["captured"] = True
except Exception as e:
    results["captured"] = False; results["error"] = repr(e)[:500]
if results["captured"]:
    errs = []
    for lengths in ([300, 200, 500, 100, 250, 400, 120, 330], [1000, 20, 30, 40, 50, 600, 200, 100], [64]*8):
        cu.copy_(bounds(lengths)); graph.replay(); torch.cuda.synchronize()
        ref = run(q, k, v, cu, max(lengths)); rq, rk, rv = torch.autograd.grad(ref, (q, k, v), g)
        n = sum(lengths)
        errs.append({"lengths": lengths, "out": (out[:n] - ref[:n]).abs().max().item(),
                     "dq": (dq[:n] - rq[:n]).abs().max().item(), "dk": (dk[:n] - rk[:n]).abs().max().item()})
    results["replays"] = errs
print(json.dumps(results))
