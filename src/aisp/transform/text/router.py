"""Semantic routing: rows go to the branch whose labelled examples their embedding is closest to.

``EmbeddingRouter`` holds, per branch, the embeddings of a few labelled examples (unit vectors;
``from_texts`` embeds example texts with the pipeline's own tokenizer and encoder). A row's score
for a branch is its best cosine similarity to that branch's examples; the row goes to the
branch that scores highest, or to ``fallback`` when no branch reaches ``threshold``. The
decision and its score are written on the row (``route``, ``route_score``), so what was routed
where can be read downstream and in outputs; ``attach`` adds the scoring step and the route step
to a stream and returns the branches' streams (the fallback among them). The scoring is one
matrix product per batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import Batch, padded
from aisp.errors import ConfigError

__all__ = ["EmbeddingRouter"]


class EmbeddingRouter:
    """Routes rows by the similarity of ``column`` to each branch's ``examples`` (see the module
    docstring)."""

    def __init__(
        self,
        examples: Mapping[str, npt.NDArray[Any]],
        *,
        threshold: float = 0.3,
        fallback: str = "other",
        column: str = "embedding",
        route_column: str = "route",
        score_column: str = "route_score",
    ) -> None:
        if not examples:
            raise ConfigError("an embedding router needs at least one branch with examples")
        if fallback in examples:
            raise ConfigError(f"the fallback {fallback!r} is also a branch with examples")
        matrices = {b: np.atleast_2d(np.asarray(v, dtype=np.float32)) for b, v in examples.items()}
        dims = {m.shape[1] for m in matrices.values()}
        if len(dims) != 1 or any(m.shape[0] == 0 for m in matrices.values()):
            raise ConfigError(f"every branch needs examples of one dimension, got {sorted(dims)}")
        self.branches = list(matrices)
        self.fallback, self.threshold = fallback, threshold
        self.column, self.route_column, self.score_column = column, route_column, score_column
        stacked = np.concatenate(list(matrices.values()))
        self._examples = stacked / np.maximum(np.linalg.norm(stacked, axis=1, keepdims=True), 1e-12)
        self._branch_of = np.repeat(np.arange(len(matrices)), [m.shape[0] for m in matrices.values()])

    @classmethod
    def from_texts(
        cls, examples: Mapping[str, Sequence[str]], tokenizer: Any, encoder: Any, **settings: Any
    ) -> EmbeddingRouter:
        """Embed each branch's example texts with ``tokenizer`` (a ``TextTokenizer``) and
        ``encoder`` (a ``TextEncoder``), as the pipeline embeds its rows."""
        vectors = {}
        for branch, texts in examples.items():
            tokens = tokenizer(Batch.from_columns({tokenizer.column: pa.array(list(texts), pa.string())}))
            inputs = {name: padded(tokens.column(name)) for name in encoder.input_names}
            vectors[branch] = encoder.run(inputs)["embedding"]
        return cls(vectors, **settings)

    def __call__(self, batch: Batch) -> Batch:
        """``batch`` with each row's branch and score."""
        vectors = np.asarray(batch.numpy(self.column), dtype=np.float32)
        names = np.array([*self.branches, self.fallback], dtype=object)
        if not batch.num_rows:
            return batch.with_columns({self.route_column: pa.array([], pa.string()),
                                       self.score_column: np.empty(0, dtype=np.float32)})  # fmt: skip
        sims = vectors @ self._examples.T  # rows x examples
        per_branch = np.stack(
            [sims[:, self._branch_of == b].max(axis=1) for b in range(len(self.branches))], axis=1
        )
        best = per_branch.argmax(axis=1)
        score = per_branch[np.arange(len(vectors)), best]
        chosen = np.where(score >= self.threshold, best, len(self.branches))
        return batch.with_columns({self.route_column: pa.array(names[chosen].tolist(), pa.string()),
                                   self.score_column: score.astype(np.float32)})  # fmt: skip

    def attach(self, stream: Any, step_id: str) -> dict[str, Any]:
        """``{step_id}.score`` (this router on each row) and ``{step_id}`` (the route by it) after
        ``stream``; the branches' streams, by name (the fallback's too)."""
        scored = stream.map_batch(f"{step_id}.score", self)
        branches = [*self.branches, self.fallback]
        return scored.route(step_id, branches, column=self.route_column, default=self.fallback)  # type: ignore[no-any-return]
