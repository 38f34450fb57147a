"""Feature drift of a model's inputs: PSI and the Kolmogorov-Smirnov statistic per feature, over
sliding windows against a reference, with an alert after N windows in a row over a threshold.

``DriftMonitor.observe(matrix)`` takes a batch's model input (rows x features) and costs one
copy into the current window. When a window of ``window_rows`` rows is full, every feature is
compared with the reference (the first window, or ``DriftConfig.reference``), vectorised over
features: PSI over the reference's deciles (``sum((p - q) * ln(p / q))``, proportions floored at
1e-4) and KS (the largest gap between the two empirical CDFs, on a sample of the reference).
A feature whose PSI or KS is over its threshold for ``consecutive`` windows in a row raises one
alert (a dict: stage, feature, psi, ks, windows over, window number, Unix ms), sent to
``on_alert`` (a log line by default, see ``alert_sink``); it is raised again only after the
feature has come back under.
The latest values are exported as metrics (``aisp_drift_psi``, ``aisp_drift_ks``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from aisp.errors import ConfigError
from aisp.observe.clock import wall_ms
from aisp.secrets import mask, read_secret

__all__ = ["DriftConfig", "DriftMonitor", "alert_sink", "ks_statistic", "local_alert", "psi"]

log = logging.getLogger("aisp.drift")
_EPS = 1e-4
_REF_SAMPLE = 4096


@dataclass(frozen=True, kw_only=True)
class DriftConfig:
    """Drift monitoring of an infer step's input features (see the module docstring).

    Args:
        window_rows: rows per window.
        psi_threshold: PSI above this is drift (0.2 is the usual "significant shift").
        ks_threshold: KS above this is drift.
        consecutive: windows in a row over a threshold before an alert.
        reference: a reference sample (rows x features); default: the first window.
        feature_names: names of the features (default ``{input}[i]``).
        alert: where alerts go: ``log``, an ``http(s)://`` webhook URL (JSON POST), a
            ``redis://HOST:PORT/STREAM`` or ``nats://HOST:PORT/STREAM`` stream (resolved by the
            executor), or a callable taking the alert dict.
    """

    window_rows: int = 5000
    psi_threshold: float = 0.2
    ks_threshold: float = 0.1
    consecutive: int = 3
    reference: npt.NDArray[Any] | None = None
    feature_names: Sequence[str] | None = None
    alert: str | Callable[[dict[str, Any]], None] = "log"

    def __post_init__(self) -> None:
        if self.window_rows < 50:
            raise ConfigError(f"drift window_rows must be >= 50, got {self.window_rows}")
        if self.consecutive < 1:
            raise ConfigError(f"drift consecutive must be >= 1, got {self.consecutive}")


def psi(ref_props: npt.NDArray[np.float64], props: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Population stability index per row of bin proportions (features x bins).

    >>> round(float(psi(np.array([[0.5, 0.5]]), np.array([[0.5, 0.5]]))[0]), 6)
    0.0
    """
    p = np.maximum(props, _EPS)
    q = np.maximum(ref_props, _EPS)
    return np.asarray(((p - q) * np.log(p / q)).sum(axis=1))


def ks_statistic(ref_sorted: npt.NDArray[Any], window: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    """Two-sample KS statistic per feature: columns of ``ref_sorted`` (sorted) vs ``window``.

    >>> r = np.sort(np.random.default_rng(0).normal(size=(2000, 1)), axis=0)
    >>> float(ks_statistic(r, r.copy())[0])
    0.0
    """
    win = np.sort(window, axis=0)
    out = np.empty(ref_sorted.shape[1])
    n_r, n_w = ref_sorted.shape[0], win.shape[0]
    for j in range(ref_sorted.shape[1]):
        points = np.concatenate([ref_sorted[:, j], win[:, j]])
        cdf_r = np.searchsorted(ref_sorted[:, j], points, side="right") / n_r
        cdf_w = np.searchsorted(win[:, j], points, side="right") / n_w
        out[j] = np.abs(cdf_r - cdf_w).max()
    return out


def local_alert(target: str) -> bool:
    """Whether ``alert_sink`` handles ``target`` itself (a log line, a webhook); other targets
    are stream URLs, resolved by ``aisp.connectors``."""
    return target == "log" or target.startswith(("http://", "https://"))


def alert_sink(
    target: str | Callable[[dict[str, Any]], None], what: str = "drift"
) -> Callable[[dict[str, Any]], None]:
    """An alert function for ``DriftConfig.alert`` (or another monitor's ``alert``, ``what`` its
    name in log lines): log, webhook (in a thread) or a callable."""
    if callable(target):
        return target
    if target == "log":
        return lambda alert: log.warning("%s alert: %s", what, json.dumps(alert))
    if target.startswith(("http://", "https://")):
        url, headers = _webhook(target, what)
        shown = mask(target)

        def post(alert: dict[str, Any]) -> None:
            def send() -> None:
                import urllib.request  # only a webhook needs it (~30 ms to import)

                req = urllib.request.Request(  # noqa: S310 - the user's own webhook URL
                    url, data=json.dumps(alert).encode(), headers=headers
                )
                try:
                    urllib.request.urlopen(req, timeout=5).close()  # noqa: S310
                except OSError as exc:
                    log.warning("%s alert webhook %s failed: %s", what, shown, mask(str(exc)))

            threading.Thread(target=send, name="aisp-drift-webhook", daemon=True).start()

        return post
    raise ConfigError(
        f"{what} alert must be 'log', an http(s):// URL, a redis:// or nats:// stream or a callable,"
        f" got {mask(target)!r}"
    )


def _webhook(target: str, what: str = "drift") -> tuple[str, dict[str, str]]:
    """The webhook's URL without its ``USER:PASSWORD@`` (and without ``password_env`` or
    ``password_file``, which say where the password is kept, as in a broker's URL), and the
    headers of a POST to it: the credentials go as HTTP basic authentication (as curl sends
    them), never in a log line.

    >>> _webhook("https://ops:pw@h/hook?x=1")
    ('https://h/hook?x=1', {'Content-Type': 'application/json', 'Authorization': 'Basic b3BzOnB3'})
    """
    import base64
    from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

    parts = urlsplit(target)
    headers = {"Content-Type": "application/json"}
    query = parse_qsl(parts.query, keep_blank_values=True)
    kept = dict(query)
    password = read_secret(
        f"{what} alert webhook {mask(target)!r}",
        unquote(parts.password) if parts.password is not None else None,
        env=kept.get("password_env"),
        file=kept.get("password_file"),
        names=("the URL's password", "password_env", "password_file"),
    )
    rest = [(k, v) for k, v in query if k not in ("password_env", "password_file")]
    if parts.username is None:
        if password is not None:
            raise ConfigError(f"{what} alert webhook {mask(target)!r}: a password needs a user (USER@HOST)")
        return target, headers
    pair = f"{unquote(parts.username)}:{password or ''}"
    headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
    host = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=host, query=urlencode(rest)).geturl(), headers


class DriftMonitor:
    """Windows of one infer step's input features, compared with a reference."""

    def __init__(
        self, stage: str, config: DriftConfig, n_features: int, feature_names: Sequence[str]
    ) -> None:
        self.stage, self.config = stage, config
        self.features = list(config.feature_names or feature_names)
        if len(self.features) != n_features:
            raise ConfigError(
                f"drift on {stage!r}: {len(self.features)} feature names for {n_features} features"
            )
        self._window = np.empty((config.window_rows, n_features), dtype=np.float64)
        self._fill = 0
        self._edges: npt.NDArray[np.float64] | None = None
        self._ref_props: npt.NDArray[np.float64] | None = None
        self._ref_sorted: npt.NDArray[np.float64] | None = None
        self._over = np.zeros(n_features, dtype=np.int64)
        self._alerted = np.zeros(n_features, dtype=bool)
        self._alert = alert_sink(config.alert)
        self.psi = np.zeros(n_features)
        self.ks = np.zeros(n_features)
        self.windows = 0
        self.alerts: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        if config.reference is not None:
            self._set_reference(np.asarray(config.reference, dtype=np.float64).reshape(-1, n_features))

    def _set_reference(self, ref: npt.NDArray[np.float64]) -> None:
        qs = np.linspace(0, 1, 11)[1:-1]
        self._edges = np.quantile(ref, qs, axis=0).T  # features x 9 inner edges
        self._ref_props = self._proportions(ref)
        step = max(1, ref.shape[0] // _REF_SAMPLE)
        self._ref_sorted = np.sort(ref[::step], axis=0)

    def _proportions(self, x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        assert self._edges is not None
        props = np.empty((x.shape[1], self._edges.shape[1] + 1))
        for j in range(x.shape[1]):
            counts = np.bincount(
                np.searchsorted(self._edges[j], x[:, j], side="right"), minlength=props.shape[1]
            )
            props[j] = counts / x.shape[0]
        return props

    def observe(self, matrix: npt.NDArray[Any]) -> None:
        """Add a batch's rows (rows x features); full windows are evaluated."""
        x = np.asarray(matrix, dtype=np.float64).reshape(matrix.shape[0], -1)
        with self._lock:
            start = 0
            while start < x.shape[0]:
                take = min(x.shape[0] - start, self._window.shape[0] - self._fill)
                self._window[self._fill : self._fill + take] = x[start : start + take]
                self._fill += take
                start += take
                if self._fill == self._window.shape[0]:
                    self._evaluate(self._window)
                    self._fill = 0

    def _evaluate(self, window: npt.NDArray[np.float64]) -> None:
        if self._edges is None:
            self._set_reference(window.copy())
            return
        assert self._ref_props is not None and self._ref_sorted is not None
        self.windows += 1
        self.psi = psi(self._ref_props, self._proportions(window))
        self.ks = ks_statistic(self._ref_sorted, window)
        over = (self.psi > self.config.psi_threshold) | (self.ks > self.config.ks_threshold)
        self._over = np.where(over, self._over + 1, 0)
        self._alerted &= over  # a feature back under may alert again later
        for j in np.flatnonzero((self._over >= self.config.consecutive) & ~self._alerted).tolist():
            self._alerted[j] = True
            alert = {
                "type": "drift",
                "stage": self.stage,
                "feature": self.features[j],
                "psi": round(float(self.psi[j]), 4),
                "ks": round(float(self.ks[j]), 4),
                "windows": int(self._over[j]),
                "window": self.windows,
                "time_unix_ms": wall_ms(),
            }
            self.alerts.append(alert)
            self._alert(alert)
