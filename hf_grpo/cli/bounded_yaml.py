"""YAML read with a bound on what its aliases expand to.

PyYAML builds an alias (``*name``) as a second reference to the anchored value, so a 1 KB file of nested aliases
(each level naming the one before twice) loads at once into a structure that holds billions of values once walked:
``hf-grpo plan --from`` flattens a framework's nested config into dotted keys, and that walk ran for minutes and
gigabytes. A batch config has hundreds of values; here the document is refused before it is built when its values,
every alias counted as the value it repeats, exceed ``MAX_VALUES`` (or when an alias names the value that holds it,
which no walk ends).
"""

from __future__ import annotations

import yaml

MAX_VALUES = 100_000


class AliasExpansionError(ValueError):
    """A YAML document whose aliases expand beyond ``MAX_VALUES`` values, or into themselves."""


class _BoundedLoader(yaml.SafeLoader):
    def compose_document(self):
        node = super().compose_document()
        _count_values(node, getattr(self, "name", "<yaml>"))
        return node


def _count_values(root: yaml.Node, name: str) -> int:
    """Values of the document walked as the nested structure it builds: an aliased node counts each time it is
    reached. Each node's count is taken once (memoized by identity), so a bomb is refused in time linear in its
    text."""
    counts: dict[int, int] = {}
    open_nodes: set[int] = set()

    def count(node: yaml.Node) -> int:
        key = id(node)
        if key in counts:
            return counts[key]
        if key in open_nodes:
            raise AliasExpansionError(
                f"{name}: an alias names the value that holds it (a recursive structure, line "
                f"{node.start_mark.line + 1}); a config is a finite tree: write the value out")
        open_nodes.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(count(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(count(k) + count(v) for k, v in node.value)
        open_nodes.discard(key)
        if total > MAX_VALUES:
            raise AliasExpansionError(
                f"{name}: holds more than {MAX_VALUES} values, each alias (*name) counted as the values it repeats "
                f"(the value at line {node.start_mark.line + 1} alone); a batch config has hundreds. Write the "
                f"repeated values out, or give only the batch settings")
        counts[key] = total
        return total

    return count(root)


def safe_load(stream):
    """``yaml.safe_load`` of ``stream``, refusing a document whose aliases expand beyond ``MAX_VALUES`` values
    (``AliasExpansionError``, a ``ValueError`` naming the file)."""
    loader = _BoundedLoader(stream)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
