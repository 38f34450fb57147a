"""``ChangelogLog``: a changelog partition read in pieces, sorted by committed offsets that move
while it is read (a standby's warm copy), resolves as one read at the end would."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.connectors.kafka.standby import COVERS, ChangelogLog, ring

KEYS = [b"a", b"b", b"c"]

records = st.lists(
    st.tuples(
        st.sampled_from(KEYS), st.integers(0, 40), st.one_of(st.none(), st.binary(min_size=1, max_size=2))
    ),
    max_size=40,
)


class Message:
    """A consumed changelog record as confluent-kafka gives it."""

    def __init__(self, at: int, key: bytes, covers: int, value: bytes | None) -> None:
        self._at, self._key, self._covers = at, key, covers
        self._value = covers.to_bytes(COVERS, "big") + value if value is not None else None

    def error(self) -> None:
        return None

    def key(self) -> bytes:
        return self._key

    def value(self) -> bytes | None:
        return self._value

    def offset(self) -> int:
        return self._at

    def headers(self) -> list[tuple[str, bytes]]:
        return [("o", str(self._covers).encode())]


def add(copy: ChangelogLog, log: list[tuple[bytes, int, bytes | None]], start: int, end: int) -> None:
    copy.add_messages([Message(at, *log[at]) for at in range(start, end)])


def reference(
    log: list[tuple[bytes, int, bytes | None]], committed: int | None
) -> tuple[dict[bytes, bytes], set[bytes]]:
    """Each key's last record in log order that counts under ``committed`` (live keys only), and
    the keys with a record that does not count after it."""
    last: dict[bytes, tuple[int, bytes | None]] = {}
    for at, (key, covers, value) in enumerate(log):
        if committed is not None and covers <= committed:
            last[key] = (at, value)
    live = {k: v for k, (_, v) in last.items() if v is not None}
    stale = {
        key
        for at, (key, covers, _) in enumerate(log)
        if (committed is None or covers > committed) and at > last.get(key, (-1, None))[0]
    }
    return live, stale


@settings(max_examples=300, deadline=None)
@given(records, st.lists(st.integers(0, 40), max_size=5), st.integers(0, 40), st.data())
def test_a_log_settled_along_the_way_resolves_as_a_read_at_the_end(
    log: list[tuple[bytes, int, bytes | None]], along: list[int], committed: int, data: st.DataObject
) -> None:
    copy = ChangelogLog()
    commits = sorted(along)  # the group's committed offset only grows
    cuts = sorted(data.draw(st.lists(st.integers(0, len(log)), min_size=len(commits), max_size=len(commits))))
    done = 0
    for cut, c in zip(cuts, commits, strict=True):
        add(copy, log, done, cut)
        done = cut
        copy.settle(c)
    final = max([committed, *commits])
    copy.settle(final)
    add(copy, log, done, len(log))
    keys, values, stale = copy.resolve()
    want_live, want_stale = reference(log, final)
    assert {k: v[COVERS:] for k, v in zip(keys, values, strict=True)} == want_live
    assert stale == want_stale
    assert copy.next == (len(log) if log else -2)


def test_nothing_counts_before_a_first_commit() -> None:
    copy = ChangelogLog()
    copy.add_messages([Message(0, b"a", 5, b"x")])
    assert copy.resolve() == ([], [], {b"a"})
    copy.settle(5)
    assert copy.resolve() == ([b"a"], [(5).to_bytes(COVERS, "big") + b"x"], set())


def test_ring_picks_the_partitions_after_the_owned_ones() -> None:
    assert ring([1], 4, 2) == {2, 3}
    assert ring([3], 4, 2) == {0, 1}
    assert ring([0, 1, 2, 3], 4, 2) == set()
    assert ring([0], 4, 9) == {1, 2, 3}
