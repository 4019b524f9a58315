"""A def-use graph of an FX graph (networkx), the substrate of the state-write analysis.

Every FX node is a vertex (keyed by the node itself); an edge ``d -> u`` means ``u`` reads the value
``d`` defines (through positional args, kwargs or nested lists/dicts of them). Graph order is kept
as the vertex attribute ``order`` so analyses can walk in program order and ask reachability
questions ("is this op's result used only as a dependency token?") without re-scanning the graph.
"""

from __future__ import annotations

from typing import Iterable

import networkx as nx
import torch.fx


class DefUse:
    """Def-use graph over the nodes of ``graph``."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph
        self.g = nx.DiGraph()
        for order, node in enumerate(graph.nodes):
            self.g.add_node(node, order=order, op=node.op)
            for inp in node.all_input_nodes:
                self.g.add_edge(inp, node)

    def inputs(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        """Nodes ``node`` reads, in argument order."""
        return list(node.all_input_nodes)

    def users(self, node: torch.fx.Node) -> list[torch.fx.Node]:
        return sorted(self.g.successors(node), key=lambda n: self.g.nodes[n]["order"])

    def order(self, node: torch.fx.Node) -> int:
        return self.g.nodes[node]["order"]

    def nodes(self) -> Iterable[torch.fx.Node]:
        return self.graph.nodes

    def reaches_output(self, node: torch.fx.Node) -> bool:
        """Whether ``node``'s value flows (transitively) into the graph output."""
        outputs = [n for n in self.graph.nodes if n.op == "output"]
        return any(out in nx.descendants(self.g, node) for out in outputs)
