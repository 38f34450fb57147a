from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aisp.errors import GraphError
from aisp.graph import Graph, Node, graph_from


def chain(*ids: str, budget: float = 1.0) -> list[Node]:
    nodes = [Node(step_id=ids[0], kind="source", latency_budget_ms=budget)]
    for up, sid in zip(ids, ids[1:], strict=False):
        kind = "sink" if sid == ids[-1] else "map_batch"
        ports = () if kind == "sink" else ("out",)
        nodes.append(Node(step_id=sid, kind=kind, inputs=(up,), ports=ports, latency_budget_ms=budget))
    return nodes


def test_valid_chain_orders_and_bounds() -> None:
    g = graph_from("g", chain("a", "b", "c", "d"))
    g.validate()
    assert [n.step_id for n in g.topological_order()] == ["a", "b", "c", "d"]
    assert g.latency_bound_ms() == 4.0
    assert g.critical_path() == ["a", "b", "c", "d"]


def test_duplicate_id_names_step() -> None:
    g = Graph("g")
    g.add(Node(step_id="a", kind="source"))
    with pytest.raises(GraphError, match="duplicate step id 'a'") as info:
        g.add(Node(step_id="a", kind="map_batch", inputs=("a",)))
    assert info.value.step == "a"


def test_unknown_input_names_step() -> None:
    nodes = chain("a", "b")
    nodes.append(Node(step_id="x", kind="sink", inputs=("nope",), ports=()))
    with pytest.raises(GraphError, match="step 'x' reads unknown step 'nope'"):
        graph_from("g", nodes).validate()


def test_unknown_port_is_rejected() -> None:
    nodes = [
        Node(step_id="a", kind="source"),
        Node(step_id="s", kind="sink", inputs=("a:missing",), ports=()),
    ]
    with pytest.raises(GraphError, match="port 'missing'"):
        graph_from("g", nodes).validate()


def test_dangling_output_names_step() -> None:
    nodes = [Node(step_id="a", kind="source"), Node(step_id="b", kind="map_batch", inputs=("a",))]
    with pytest.raises(GraphError, match="output 'b' of step 'b' goes nowhere") as info:
        graph_from("g", nodes).validate()
    assert info.value.step == "b"


def test_no_source_rejected() -> None:
    with pytest.raises(GraphError, match="no source"):
        graph_from("g", [Node(step_id="a", kind="sink", inputs=("a",), ports=())]).validate()


def test_longest_path_over_branches() -> None:
    nodes = [
        Node(step_id="src", kind="source", latency_budget_ms=1),
        Node(step_id="fast", kind="map_batch", inputs=("src",), latency_budget_ms=1),
        Node(step_id="slow", kind="infer", inputs=("src",), latency_budget_ms=20),
        Node(step_id="u", kind="union", inputs=("fast", "slow"), latency_budget_ms=0.5),
        Node(step_id="out", kind="sink", inputs=("u",), ports=(), latency_budget_ms=2),
    ]
    g = graph_from("g", nodes)
    g.validate()
    assert g.latency_bound_ms() == pytest.approx(23.5)
    assert g.critical_path() == ["src", "slow", "u", "out"]
    assert "static end-to-end latency bound: 23.5 ms" in g.render()


@st.composite
def dags(draw: st.DrawFn) -> list[Node]:
    """Random DAGs: node i reads from earlier nodes only; every output is consumed."""
    n = draw(st.integers(min_value=2, max_value=12))
    nodes: list[Node] = [Node(step_id="n0", kind="source")]
    for i in range(1, n):
        k = draw(st.integers(min_value=1, max_value=min(2, i)))
        ups = draw(st.lists(st.integers(0, i - 1), min_size=k, max_size=k, unique=True))
        kind = "union" if len(ups) > 1 else "map_batch"
        nodes.append(Node(step_id=f"n{i}", kind=kind, inputs=tuple(f"n{u}" for u in ups)))
    consumed = {ref for node in nodes for ref in node.inputs}
    for node in list(nodes):
        if node.step_id not in consumed:
            nodes.append(Node(step_id=f"sink_{node.step_id}", kind="sink", inputs=(node.step_id,), ports=()))
    return nodes


@given(dags())
def test_random_dags_validate_in_topological_order(nodes: list[Node]) -> None:
    g = graph_from("g", nodes)
    g.validate()
    pos = {n.step_id: i for i, n in enumerate(g.topological_order())}
    for up, _, down in g.edges():
        assert pos[up] < pos[down]


@given(dags(), st.data())
def test_a_back_edge_is_always_rejected(nodes: list[Node], data: st.DataObject) -> None:
    g = graph_from("g", nodes)
    inner = [n.step_id for n in g.topological_order() if n.kind not in ("source", "sink")]
    if not inner:
        return
    start = data.draw(st.sampled_from(inner))
    # every inner node reachable from `start` (itself included): reading from one closes a cycle
    reach, frontier = {start}, [start]
    while frontier:
        sid = frontier.pop()
        for up, _, down in g.edges():
            if up == sid and down not in reach and g.node(down).kind != "sink":
                reach.add(down)
                frontier.append(down)
    back = data.draw(st.sampled_from(sorted(reach)))
    target = g.node(start)
    g.replace(start, kind="union", inputs=(*target.inputs, back))
    with pytest.raises(GraphError, match="cycle"):
        g.validate()
