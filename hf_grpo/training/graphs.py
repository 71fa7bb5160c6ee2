"""The training micro-batch's forward and backward replayed from CUDA graphs, one pair per shape bucket.

At 0.5B the training half is bound by the host (``docs/performance.md``): a graph launches a whole forward or
backward as one unit. 8 x 640 tokens on an H200: 133-150 ms eager, 67 ms replayed (``bench/training_graph_probe.py``).

How (``training_cuda_graphs``, "auto" by default):

* A micro-batch is brought to a static shape (``graph_inputs``): padded to a bucket, or with ``padding_free`` its
  rows packed into one sequence of a bucketed length, with the row bounds in a device tensor. Each (rows, layout,
  length, scored width) gets one forward graph and one backward graph, captured on a side stream (after an eager
  warm-up pass for the run's first capture, and for every bucket's with compiled layers: ``WARMUP_PASSES``), the
  random stream restored after; packed, after its first few where a larger captured shape fits (``shape_reuse``).
* The forward graph computes the completion's log-probs (and entropies) through the model's chunked head in its
  static-shape form (``scored_window``: a fixed number of positions, unscored ones zeroed), since selecting scored
  tokens by mask has a data-dependent size that a graph cannot hold. Padded, that is the completion window; packed,
  the scored tokens gathered in a power-of-two width. Outside the graph they go back to TRL's layout (``spread``).
* The rollout's no-grad scoring (reference, old policy) replays forward-only graphs in those forms (``scorer``).
* The backward graph accumulates into the ``.grad`` tensors it was captured with (``grad_buffers``, kept through
  the rollout), the parameters' gradients again before each replay. The replay is an autograd node of the loss:
  TRL's loss, the Trainer's backward and the out-of-memory back-off work unchanged. Under DeepSpeed and DDP the
  node hands the buffers to autograd, whose accumulation runs their reduction hooks after the replay (``Replay``
  handed over, amid their forward's work: ``ddp_replay``; through views, ``parameter_aliases``). ZeRO-3: with one
  process (no hooks), and non-reentrant checkpointing (autograd.grad reaches no parameter in a reentrant one).
* Every graph shares one memory pool (they run one at a time), which keeps through the rollout what the largest
  bucket needs at its peak: checkpointed, its layer inputs and a layer's recompute (0.6 GiB more reserved at 0.5B);
  without, a whole micro-batch's activations, so "auto" leaves such runs eager.
* Graphs are dropped when a parameter moves (``weights_signature``). A capture that fails twice (a host wait, a model
  a graph cannot hold, out of memory) ends a run with "on", sends one with "auto" on eagerly. The device sits behind
  ``CudaGraphRecorder``; the tests run everything else on a CPU through an eager stand-in.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext

import torch

from ..distributed import ddp_replay
from ..run_state import RunDecisions, RunFacts, RunSizes
from ..runtime.graph_capture import weights_signature
from . import eager_packing, graph_inputs, padding_free, rank_shapes, shape_reuse
from .cuda_graph_recorder import CudaGraphRecorder, capture_twice, first_of_each_shape
from .graph_buckets import Bucket, Replay, chunked_scoring
from .parameter_aliases import ParameterAliases
from .shape_reuse import Shape

logger = logging.getLogger(__name__)

SETTINGS = ("auto", "on", "off")
# Eager passes on the capture stream before a capture (the run's first, a later bucket's): the first loads the
# kernels and sets up cuBLAS for the stream. Eager layers need no more for another shape (a later pass cost 0.25 s
# and 0.6 GiB of peak); compiled layers may compile or tune again for a new shape, impossible inside a capture. A
# capture that fails is tried once more after an eager pass (``capture_twice``).
WARMUP_PASSES = {"eager": (1, 0), "compiled": (2, 1)}
# Captured shapes kept per table (training, scoring), the least recently used dropped beyond: packed rows meet ~30
# shapes at prompts of 32-384 tokens, ~100 at 64-1024 (95% of micro-batches in the 64 most used); each is small.
MAX_BUCKETS = 64
_CAPTURABLE_ATTENTION = ("sdpa", "eager")  # flash-attention's varlen path reads sequence lengths on the host


def validate_setting(value: str) -> None:
    if value not in SETTINGS:
        raise ValueError(f"training_cuda_graphs must be one of {list(SETTINGS)}, got {value!r}")


def unavailable_reason(facts: RunFacts, sizes: RunSizes, chunked_head: bool = True) -> str | None:
    """Why this run's training micro-batches cannot be replayed from CUDA graphs; None when they can.
    ``chunked_head``: the policy's head runs hf_grpo's chunked form (not TRL's fused head)."""
    if facts.training_graphs_unavailable:
        return facts.training_graphs_unavailable
    if (reason := CudaGraphRecorder.device_reason(torch.device(facts.device_type))) is not None:
        return reason
    if facts.fsdp:
        return "FSDP gathers and reduces each layer's parameters in hooks a graph cannot hold"
    if facts.deepspeed and facts.zero3 and not facts.zero3_hooks_removed:  # (one process: no hooks, zero3_one_process)
        return "ZeRO-3 gathers each layer's parameters in hooks a graph cannot hold"
    if facts.reentrant_checkpointing and (facts.deepspeed or facts.num_processes > 1):  # (handed over: Replay)
        return "reentrant activation checkpointing (use_reentrant=True): its parameters' gradients are not handed over"
    if not facts.deepspeed and facts.n_gpu > 1:
        return "torch.nn.DataParallel copies the model to each GPU in every forward"
    if sizes.max_tokens_per_micro_batch is not None:
        return "max_tokens_per_micro_batch splits micro-batches into passes of varying rows"
    if facts.attention not in _CAPTURABLE_ATTENTION:
        return f"attention {facts.attention!r} (capturable: {list(_CAPTURABLE_ATTENTION)})"
    if facts.moe:
        return "a mixture-of-experts model routes tokens with data-dependent shapes"
    if not chunked_head:
        return "the model keeps TRL's fused head (its scored tokens are selected by mask)"
    return None


def choose(settings, model: torch.nn.Module, facts: RunFacts, sizes: RunSizes, decisions: RunDecisions,
           wrapper=None) -> tuple[TrainingGraphs | None, str | None]:
    """``(TrainingGraphs or None, why not)`` for the run's ``training_cuda_graphs`` setting (``settings``: its
    config, read only); ``decisions``: layers compiled, head chunked; ``wrapper``: the model as the Trainer wraps it."""
    setting = settings.training_cuda_graphs
    if setting == "off":
        return None, "training_cuda_graphs='off'"
    ddp = facts.num_processes > 1 and not facts.deepspeed  # (FSDP is refused first)
    reason = unavailable_reason(facts, sizes, decisions.chunked_head) or (
        ddp_replay.unsupported_reason(wrapper) if ddp else None)
    if reason is not None:
        if setting == "on":
            logger.warning("training_cuda_graphs='on' is not applied: %s", reason)
        return None, reason
    if setting == "auto" and (bound := eager_packing.gpu_bound_reason(decisions.eager_rows)) is not None:
        return None, bound + " (training_cuda_graphs='on' replays anyway)"
    if setting == "auto" and not facts.activation_checkpointing:
        # Checkpointed, the pool keeps little more than the layers' inputs; without, it would keep a whole
        # micro-batch's activations through the rollout, which eager training hands back to it.
        return None, ("activation checkpointing is off: the graphs' memory pool would keep a micro-batch's "
                      "activations through the rollout (training_cuda_graphs='on' replays anyway)")
    pad = facts.pad_token_id  # TRL's tokenizer's (pads are masked: any id does)
    # compiled layers (ours, or the Trainer's torch_compile) may compile again for a new shape: warm every bucket up
    compiled = decisions.train_layers is not None or bool(getattr(settings, "torch_compile", 0))
    return TrainingGraphs(model, pad if pad is not None else 0, eager_on_failure=setting == "auto",
                          compiled_layers=compiled, packed=unpacked_reason(settings.padding_free, model, facts) is None,
                          hand_over=facts.deepspeed or ddp, over_ranks=facts.num_processes > 1), None


def unpacked_reason(setting: bool | None, model: torch.nn.Module, facts: RunFacts) -> str | None:
    """Why the graphs replay this run's micro-batches padded rather than packed (``setting``: ``padding_free``);
    None: packed."""
    if setting is False:
        return "padding_free=False"
    reason = padding_free.unsupported_reason(model)
    if reason is not None:
        return reason
    if padding_free.varlen_attn is None or not facts.half:
        # the other packed attention, a call per row, reads the row bounds on the host: a graph would keep them
        return "packed rows replay only through variable-length flash attention (fp16/bf16, torch >= 2.9)"
    return None


def start(settings, model: torch.nn.Module, facts: RunFacts, sizes: RunSizes, decisions: RunDecisions,
          main: bool, wrapper=None) -> TrainingGraphs | None:
    """The run's graphs at train begin (``choose``), the choice logged on ``main`` beside the compile's."""
    graphs, reason = choose(settings, model, facts, sizes, decisions, wrapper)
    if main:
        # the eager micro-batches' layout (eager_packing), chosen before
        eager_rows = decisions.eager_rows
        how = f"eager launches ({reason})" + (f", {eager_rows}" if eager_rows is not None else "")
        if graphs is not None:
            padded = f"rows padded ({unpacked_reason(settings.padding_free, model, facts)})"
            how = "replayed from CUDA graphs, " + ("rows packed" if graphs.packed else padded)
        logger.info("training micro-batches: %s", how)
    return graphs


def replay(graphs: TrainingGraphs | None, perf, autocast: Callable, model, input_ids, attention_mask, logits_to_keep,
           batch_size=None, compute_entropy=False, compute_aux_loss=False, **model_inputs):
    """TRL's ``_get_per_token_logps_and_entropies`` where the run has ``graphs``: a training micro-batch replayed
    (new captures counted in ``perf`` as ``train_graph_captures``, micro-batches replayed in a larger captured shape
    as ``train_graph_reuses``), the rollout's no-grad scoring replayed alike; None where it runs as TRL's (no graphs
    or a failed capture, images, the MoE auxiliary loss, a micro-batch of another model or outside training).
    ``autocast`` is the accelerator's."""
    if graphs is None or compute_aux_loss or any(value is not None for value in model_inputs.values()):
        return None
    if graphs.failure is not None and not graphs.over_ranks:  # (else the scorer or logps join the agreement)
        return None
    before = (graphs.captures, graphs.reuse.reused)

    def counted(result):
        perf.add("train_graph_captures", float(graphs.captures - before[0]))
        perf.add("train_graph_reuses", float(graphs.reuse.reused - before[1]))
        return result

    def score(inputs, window):  # TRL's labels: only the scored positions (graph_inputs) reach the head
        with autocast():
            out = model(**graph_inputs.model_kwargs(inputs, window))
        return out.log_probs[:, -window:], (out.entropy[:, -window:] if compute_entropy else None)

    if batch_size is not None and not torch.is_grad_enabled():
        # The rollout's scoring (reference, old policy): forward-only graphs, in the training graphs' static form
        # and through the same head, so that at equal weights its log-probs are the replayed ones, to the bit.
        scored = chunked_scoring(graphs.scorer(score, model, compute_entropy), input_ids, attention_mask,
                                 logits_to_keep, batch_size)
        return counted((*scored, None))
    around = ddp_replay.around_replay(model, graphs.model) if graphs.hand_over else None  # (DeepSpeed's or DDP's)
    wrapper, model = (model, graphs.model) if around is not None else (None, model)  # the module it wraps
    if batch_size is not None or model is not graphs.model or not torch.is_grad_enabled() or not model.training:
        return None
    run = lambda: graphs.logps(score, input_ids, attention_mask, logits_to_keep, compute_entropy)  # noqa: E731
    result = run() if wrapper is None or graphs.failure is not None else around(wrapper, run)
    return counted(None if result is None else (*result, None))


class TrainingGraphs:
    """Captured buckets of one model's training forward/backward; ``logps`` runs a micro-batch through them."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int, eager_on_failure: bool = True,
                 recorder: CudaGraphRecorder | None = None, compiled_layers: bool = False, packed: bool = False,
                 reuse: shape_reuse.ShapeReuse | None = None, hand_over: bool = False, over_ranks: bool = False):
        self.model = model
        self.hand_over = hand_over  # DeepSpeed or DDP reduce .grad: the replay's node hands gradients over (module doc)
        self.over_ranks = over_ranks  # several processes: each micro-batch's shape agreed over them (rank_shapes)
        self.packed = packed  # rows packed into one sequence where they allow it (padding_free), else padded
        self.warmup_passes = WARMUP_PASSES["compiled" if compiled_layers else "eager"]
        self.eager_on_failure = eager_on_failure
        self.recorder = recorder or CudaGraphRecorder()
        self.pad_token_id = pad_token_id
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grad_buffers: list[torch.Tensor] | None = None
        self._reached: list[bool] | None = None  # which parameters the backward reaches (handed over)
        self._aliases = ParameterAliases(model, self.params) if hand_over else None  # (captured through views)
        self.captures = 0  # graphs captured over the run, training buckets and scoring (perf/train_graph_captures)
        # a new packed shape's first micro-batches replayed in a captured larger one (perf/train_graph_reuses)
        self.reuse = reuse if reuse is not None else shape_reuse.ShapeReuse(shape_reuse.head_share(model))
        self.failure: str | None = None  # why graphs were given up, once they were
        self._entries: OrderedDict[tuple, Bucket] = OrderedDict()  # training micro-batches
        self._scoring: OrderedDict[tuple, Bucket] = OrderedDict()  # the rollout's scoring, forward only
        self._warmed: set[str] = set()  # the kinds of capture ("train", "score") warmed up once already
        self._signature = None
        self._pool = None
        self._anchor = torch.zeros((), requires_grad=True)
        self._rng_before_capture: torch.Tensor | None = None

    def logps(self, score: Callable, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_width: int,
              compute_entropy: bool):
        """``(logps, entropies)`` of the completion's ``completion_width`` columns, as ``score(inputs, window)``
        computes them eagerly from the micro-batch's static form (``static_inputs``); None after a failed capture."""
        if self.failure is not None:
            if self.over_ranks:
                rank_shapes.join_without_a_batch()
            return None
        signature = weights_signature(self.model)
        if signature != self._signature:
            self._entries.clear()  # a moved parameter or a changed forward path: every graph reads stale memory
            self._signature = signature
        rows = input_ids.shape[0]
        fit = self._fit("train", rows, compute_entropy, lambda: self._entries)
        batch = self.static_inputs(input_ids, attention_mask, completion_width, fit)
        shape = Shape(rows, *batch.key, batch.window, compute_entropy)
        entry = self._entries.get(shape)
        if entry is None:
            entry = capture_twice(lambda warm: self._capture(score, batch.inputs, batch.window, shape, warm),
                                  self._recover, self._failed)
            if entry is None:  # eager for the rest of the run ("auto")
                return None
        else:
            self._entries.move_to_end(shape)
            entry.load(batch.inputs)
        inputs = self._reached_params(self.params) if self.hand_over else [self._anchor]  # (where gradients go)
        logps, entropy = Replay.apply(self, entry, *inputs)
        return batch.spread(logps), (batch.spread(entropy) if entropy is not None else None)

    def static_inputs(self, input_ids, attention_mask, completion_width: int,
                      fit: Callable[[int, int, int], tuple[int, int, int]] | None = None
                      ) -> graph_inputs.StaticBatch:
        """A micro-batch in the run's static layout, of the same shape on every rank (``rank_shapes``); packed at
        the length and scored width ``fit`` gives (see ``graph_inputs.packed``)."""
        return rank_shapes.static_batch(self.model, input_ids, attention_mask, completion_width, self.pad_token_id,
                                        packed=self.packed, over_ranks=self.over_ranks, fit=fit)

    def scorer(self, score: Callable, model: torch.nn.Module, compute_entropy: bool) -> Callable:
        """``score_rows(input_ids, attention_mask, completion_width)`` for ``chunked_scoring`` without gradients
        (the rollout's reference and old-policy scoring): ``score`` on the rows' static form, replayed from a
        forward-only graph per model state and shape, in the training graphs' pool (the scoring runs between steps,
        never between a micro-batch's forward and backward); after a failed capture, ``score`` itself."""
        signature = weights_signature(model)  # the reference model, or the policy with its adapters as they are

        def captured():
            return (shape for owner, shape in self._scoring if owner == signature)

        def logps(batch, key):
            if self.failure is not None:
                return score(batch.inputs, batch.window)
            entry = self._scoring.get(key)
            if entry is None:
                entry = capture_twice(lambda warm: self._capture_scoring(score, model, batch, key, warm),
                                      self._recover, self._failed)
                if entry is None:
                    return score(batch.inputs, batch.window)
            else:
                self._scoring.move_to_end(key)
                entry.load(batch.inputs)
            entry.replay_forward()
            return entry.logps.clone(), (entry.entropy.clone() if entry.entropy is not None else None)

        def score_rows(input_ids, attention_mask, completion_width: int):
            rows = input_ids.shape[0]
            fit = None if self.failure is not None else self._fit(signature, rows, compute_entropy, captured)
            batch = self.static_inputs(input_ids, attention_mask, completion_width, fit)
            key = (signature, Shape(rows, *batch.key, batch.window, compute_entropy))
            chunk_logps, chunk_entropies = logps(batch, key)
            return batch.spread(chunk_logps), (None if chunk_entropies is None else batch.spread(chunk_entropies))

        return score_rows

    def _fit(self, owner, rows: int, entropy: bool,
             captured: Callable) -> Callable[[int, int, int], tuple[int, int, int]]:
        """``graph_inputs.packed``'s ``fit`` for a micro-batch of ``rows`` rows: the length, shared places and
        scored width of the captured shape of ``owner`` (the training table, or a scoring model's) it replays in
        (``shape_reuse``)."""
        def fit(length: int, shared: int, window: int) -> tuple[int, int, int]:
            chosen = self.reuse.choose(owner, Shape(rows, "packed", length, shared, window, entropy), captured())
            return chosen.length, chosen.shared, chosen.window

        return fit

    def adopt_gradients(self) -> None:
        """Make the captured gradient buffers the parameters' ``.grad`` again, keeping what they hold."""
        for param, buffer in zip(self.params, self.grad_buffers):
            if param.grad is buffer:
                continue
            if param.grad is None:
                buffer.zero_()
            else:
                buffer.copy_(param.grad)
            param.grad = buffer

    def handed_over_buffers(self) -> list[torch.Tensor]:
        """The gradients the last backward replay wrote, of the parameters it reaches (``Replay``, handed over)."""
        return self._reached_params(self.grad_buffers)

    def _reached_params(self, tensors: list) -> list:
        return [tensor for tensor, reached in zip(tensors, self._reached) if reached]

    def give_up(self, reason: str, err: Exception | None = None) -> None:
        self.failure = reason
        self._recover()
        logger.warning("training_cuda_graphs: capturing the training step failed (%s); the run goes on with "
                       "eager micro-batches (training_cuda_graphs='off' skips the attempt)", reason, exc_info=err)

    def _failed(self, err: Exception) -> None:
        """A capture failed: raise it again with "on"; with "auto" give graphs up for the rest of the run."""
        if not self.eager_on_failure:
            self._recover()
            raise err
        self.give_up(f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:300]}", err)

    def _recover(self) -> None:
        """After a failed capture: no graphs (their pool and, once the Trainer lets go of them, the gradient
        buffers freed), the random stream usable and where it was before the capture."""
        self._entries.clear()
        self._scoring.clear()
        self._pool = None
        self.grad_buffers = None  # gradients accumulated into them this step stay the parameters' until zeroed
        self.recorder.recover()
        if self._rng_before_capture is not None:
            self.recorder.set_random_state(self._rng_before_capture)
            self._rng_before_capture = None

    # ---- capture ---------------------------------------------------------------------------------------------
    def _warm_up(self, score: Callable, entry: Bucket, window: int, warm: bool) -> None:
        """Eager passes before a capture: the run's first computes every gradient (nothing is accumulated yet); a
        later one, mid-step, only the first parameter's of each shape (``first_of_each_shape``)."""
        first = "train" not in self._warmed
        self._warmed.add("train")
        for _ in range(max(self.warmup_passes[0 if first else 1], int(warm))):
            # handed over, as the capture runs: through views, never a backward into DeepSpeed's .grad and hooks
            with self._aliases.swapped() if self.hand_over else nullcontext(self.params) as targets:
                logps, _ = score(entry.inputs, window)
                if first and not self.hand_over:
                    for param in self.params:
                        param.grad = None
                    logps.sum().backward()
                    for param in self.params:
                        param.grad = None
                else:
                    some = targets if first else [targets[i] for i in first_of_each_shape(self.params)]
                    torch.autograd.grad(logps.sum(), some, allow_unused=True)

    @contextmanager
    def _random_stream_kept(self) -> Iterator[None]:
        """A capture must not move the random stream the rollouts sample from (restored here, or in give_up)."""
        self._rng_before_capture = self.recorder.random_state()
        yield
        self.recorder.set_random_state(self._rng_before_capture)
        self._rng_before_capture = None

    def _kept(self, table: OrderedDict, key: tuple, entry: Bucket) -> Bucket:
        """A captured ``entry`` counted and kept in ``table``, whose oldest is dropped beyond ``MAX_BUCKETS``."""
        table[key] = entry
        self.captures += 1
        while len(table) > MAX_BUCKETS:
            table.popitem(last=False)
        return entry

    def _capture_scoring(self, score: Callable, model: torch.nn.Module, batch, key: tuple, warm: bool) -> Bucket:
        entry, window = Bucket(batch.inputs), batch.window
        if self._pool is None:
            self._pool = self.recorder.new_pool()
        passes = max(self.warmup_passes[1 if "score" in self._warmed else 0], int(warm))
        self._warmed.add("score")
        with self._random_stream_kept():
            with self.recorder.side_stream():
                for _ in range(passes):
                    score(entry.inputs, window)
            entry.replay_forward, (entry.logps, entry.entropy) = self.recorder.record(
                lambda: score(entry.inputs, window), self._pool, model)
        return self._kept(self._scoring, key, entry)

    def _capture(self, score: Callable, inputs: dict, window: int, shape: tuple, warm: bool) -> Bucket:
        recorder = self.recorder
        if self.grad_buffers is None:
            self.grad_buffers = [torch.zeros_like(p) for p in self.params]
        if self._pool is None:
            self._pool = recorder.new_pool()
        entry = Bucket(inputs)
        held = [p.grad for p in self.params]  # the step's gradients so far: the warm-up must not add to them
        scored = {}  # the forward's outputs with their autograd graph, which the backward's capture runs through
        swaps = ExitStack()  # handed over: the parameters' views, from the forward's capture to the backward's end

        def forward():
            if self.hand_over:
                scored["views"] = swaps.enter_context(self._aliases.swapped())
            scored["outputs"] = score(entry.inputs, window)
            return scored["outputs"]

        def backward():
            # No retain_graph: the saved activations go back to the pool, for the next bucket's capture.
            if not self.hand_over:
                torch.autograd.backward(scored["outputs"][0], entry.grad_logps)
                return
            with swaps:  # the parameters back in their places at the end of the backward
                grads = torch.autograd.grad(scored["outputs"][0], scored["views"], entry.grad_logps,
                                            allow_unused=True)
            reached = [grad is not None for grad in grads]
            if not any(reached):  # (a reentrant checkpoint, say): a replay would hand nothing over
                raise RuntimeError("the captured backward reaches no trained parameter")
            if self._reached is not None and reached != self._reached:
                raise RuntimeError("a bucket's backward reaches other parameters than the first bucket's")
            self._reached = reached
            for buffer, grad in zip(self.grad_buffers, grads):
                if grad is not None:
                    buffer.copy_(grad)

        with self._random_stream_kept():
            try:
                with recorder.side_stream():
                    self._warm_up(score, entry, window, warm)
                if not self.hand_over:
                    for param, buffer in zip(self.params, self.grad_buffers):
                        param.grad = buffer  # the backward graph accumulates into these addresses
                entry.replay_forward, (entry.logps, entry.entropy) = recorder.record(forward, self._pool, self.model)
                entry.grad_logps = torch.zeros_like(entry.logps)
                entry.replay_backward, _ = recorder.record(backward, self._pool, self.model)
            finally:
                swaps.close()
                for param, grad in zip(self.params, held):
                    param.grad = grad
        entry.logps = entry.logps.detach()
        entry.entropy = entry.entropy.detach() if entry.entropy is not None else None
        return self._kept(self._entries, shape, entry)
