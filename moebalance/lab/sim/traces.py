"""Router traces for the simulator: recorded ones, and a generator fitted to them.

A trace is ``counts [T, L, E]``: tokens routed to each expert of each MoE layer at each step
(what :func:`moebalance.attach` records and ``scripts/record_trace.py`` saves). The
simulator scales every step and layer to the model's pairs per step, so only shares matter.

The generator (:func:`generate_trace`) models an expert's log share as three parts:

* **base popularity**: :func:`moebalance.lab.workloads.synthetic_loads` (Zipf over a random
  permutation, group heat, noise; DeepSeek-V3-like at "moderate" skew);
* **drift**: a slow random walk of each expert's level, ``u_t = (1 - theta) u_{t-1} + sigma_drift
  * N(0, 1)``, pulled back toward the base popularity (``theta`` keeps its spread near
  ``level_band`` log units: a trained model's balancing loss or bias keeps popularity in a band);
* **fluctuation**: step-to-step noise ``r_t = rho r_{t-1} + sigma_step sqrt(1 - rho^2) N(0, 1)``
  plus **bursts**, a one-step jump of ``burst_size * sigma_step`` (random sign) with
  probability ``burst_rate`` per expert and step.

Shares are the softmax of the sum per layer, capped at ``1 / K`` (one pair per token and
expert); counts are a multinomial draw of the step's pairs. ``sigma_drift``, ``rho``,
``sigma_step``, ``burst_rate`` and ``burst_size`` come from :func:`fit_dynamics` on a recorded
trace (default: both shipped traces, pooled); the skew comes from the base popularity, not from
the recorded traces (tiny models trained without a balancing loss, far more skewed than a
balanced large model). The step-to-step part is fitted on the recorded runs' batches (16
sequences a step) and scaled to the generated run's batch (``sequences``; the simulator passes
the cluster's tokens per step over the model's sequence length): an expert's share in a step
averages its sequences, so the part one batch's contents add shrinks as ``1 / sqrt(sequences)``
(the multinomial draw adds the sampling part at the generated token count). Per-rank differences are
not generated: the recorded traces count the whole group's tokens per step, and with the per-step
re-split every replica gets its share of the global tokens whatever each rank sends (only the send
side of the all-to-all would change).

Legend: T steps, L layers, E experts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..._check import positive_int
from ..workloads import cap_shares, synthetic_loads, trace_loads, trace_names

__all__ = ["Dynamics", "fit_dynamics", "default_dynamics", "generate_trace", "read_trace"]

# Experts routed fewer pairs than this in a median step are left out of the fit: their log
# share is mostly sampling noise.
_MIN_MEAN_COUNT = 30.0
# Steps of the moving average that separates an expert's level from its step-to-step noise.
_LEVEL_WINDOW = 15


@dataclass(frozen=True)
class Dynamics:
    """Step-to-step behaviour of expert loads (see the module docstring)."""

    sigma_drift: float
    rho: float
    sigma_step: float
    burst_rate: float
    burst_size: float
    level_band: float = 0.5
    sequences: float = 0.0
    fitted_on: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def fit_dynamics(counts_TLE: np.ndarray, name: str = "trace", sequences: float = 0.0) -> Dynamics:
    """Estimate :class:`Dynamics` from a recorded trace.

    The first fifth of the steps is left out (a freshly initialised router is still settling
    there). Per layer and well-routed expert: the log share ``y_t``; its level is the moving
    median over ``_LEVEL_WINDOW`` steps and the fluctuation ``r_t = y_t - level_t``. Spreads
    are robust (median absolute deviation), so bursts do not inflate them:

    * ``level_band``: spread of the level around the expert's mean level;
    * ``sigma_drift``: from the spread of the level's change over a window, inverting the
      pulled-back walk's ``var = 2 band^2 (1 - (1 - theta)^W)``;
    * ``sigma_step``: spread of ``r``, less the multinomial sampling part (variance about
      ``1 / count``, its median); ``rho``: lag-1 autocorrelation of ``r`` clipped at 3 spreads;
    * ``burst_rate``: share of steps with ``|r| > 4`` spreads; ``burst_size``: their mean
      ``|r|`` in units of ``sigma_step``.

    ``sequences``: independent sequences per step of the recorded run (0: unknown), kept so
    :func:`generate_trace` can scale the step-to-step part to another batch.
    """
    c = np.asarray(counts_TLE, dtype=np.float64)
    if c.ndim != 3 or c.shape[0] < 5 * _LEVEL_WINDOW:
        raise ValueError(f"counts_TLE must be [steps, layers, experts] with at least "
                         f"{5 * _LEVEL_WINDOW} steps to fit dynamics, got shape {c.shape}")
    c = c[c.shape[0] // 5:]
    W = _LEVEL_WINDOW
    levels, changes, fluct, sampling = [], [], [], []
    for layer in range(c.shape[1]):
        total = c[:, layer].sum(axis=1, keepdims=True)
        keep = np.median(c[:, layer], axis=0) >= _MIN_MEAN_COUNT
        if not keep.any():
            continue
        y = np.log(np.maximum(c[:, layer, keep], 0.5) / total)
        windows = np.lib.stride_tricks.sliding_window_view(y, W, axis=0)   # [T-W+1, n, W]
        level = np.median(windows, axis=2)
        r = y[W // 2: W // 2 + level.shape[0]] - level
        levels.append((level - level.mean(axis=0)).ravel())
        changes.append((level[W:] - level[:-W]).ravel())
        fluct.append(r)
        sampling.append(1.0 / np.maximum(c[W // 2: W // 2 + level.shape[0], layer, keep], 1))
    if not fluct:
        raise ValueError(f"{name}: no expert is routed {_MIN_MEAN_COUNT:.0f}+ pairs in a median "
                         f"step; record more tokens per step to fit dynamics")
    band = _robust_sd(np.concatenate(levels))
    var_w = _robust_sd(np.concatenate(changes)) ** 2
    sigma_drift = _drift_for(var_w, band, W)
    spread = _robust_sd(np.concatenate([r.ravel() for r in fluct]))
    sampling_var = float(np.median(np.concatenate([x.ravel() for x in sampling])))
    sigma_step = float(np.sqrt(max(spread ** 2 - sampling_var, 1e-6)))
    clipped = [np.clip(r, -3 * spread, 3 * spread) for r in fluct]
    rho = float(sum((r[1:] * r[:-1]).sum() for r in clipped) / sum((r * r).sum() for r in clipped))
    r = np.concatenate([x.ravel() for x in fluct])
    burst = np.abs(r) > 4 * spread
    size = float(np.abs(r[burst]).mean() / sigma_step) if burst.any() else 0.0
    return Dynamics(sigma_drift=sigma_drift, rho=rho, sigma_step=sigma_step,
                    burst_rate=float(burst.mean()), burst_size=size, level_band=band,
                    sequences=float(sequences), fitted_on=name)


def _robust_sd(x: np.ndarray) -> float:
    """Standard deviation from the median absolute deviation (exact for a Gaussian)."""
    return float(1.4826 * np.median(np.abs(x - np.median(x))))


def _drift_for(var_w: float, band: float, window: int) -> float:
    """The per-step sigma of a walk pulled back with ``theta = sigma^2 / (2 band^2)`` whose
    change over ``window`` steps has variance ``var_w`` (bisection; capped at the band)."""
    if band <= 0 or var_w <= 0:
        return 0.0
    if var_w >= 2 * band ** 2:
        return float(band * np.sqrt(2.0))
    lo, hi = 0.0, band * np.sqrt(2.0)
    for _ in range(60):
        mid = (lo + hi) / 2
        theta = mid ** 2 / (2 * band ** 2)
        if 2 * band ** 2 * (1 - (1 - theta) ** window) < var_w:
            lo = mid
        else:
            hi = mid
    return float(lo)


def default_dynamics() -> Dynamics:
    """:func:`fit_dynamics` on the shipped traces, pooled (means of their fits)."""
    fits = []
    for n in trace_names():
        counts, meta = trace_loads(n)
        fits.append(fit_dynamics(counts, n, sequences=float(meta.get("batch", 0))))
    mean = {k: float(np.mean([getattr(f, k) for f in fits]))
            for k in ("sigma_drift", "rho", "sigma_step", "burst_rate", "burst_size", "level_band",
                      "sequences")}
    return Dynamics(**mean, fitted_on=" + ".join(f.fitted_on for f in fits))


def generate_trace(steps: int, *, num_layers: int = 58, num_experts: int = 256,
                   num_groups: int = 8, top_k: int = 8, tokens: int = 8192,
                   skew: str = "moderate", dynamics: Dynamics | None = None,
                   sequences: float | None = None, seed: int = 0) -> np.ndarray:
    """A seeded trace [steps, L, E] of integer counts (float64), each step and layer summing
    to ``tokens * top_k``; DeepSeek-V3's shape by default. See the module docstring.

    ``sequences``: independent sequences in one step of the generated run. When both it and
    the dynamics' ``sequences`` are known, the step-to-step part (fluctuation and bursts) is
    scaled by ``sqrt(dynamics.sequences / sequences)``: a step's load is a sum over its
    sequences, and what one batch's contents add to an expert's share averages out over
    more of them. The drift (the router learning) is not scaled."""
    positive_int(steps, "steps")
    d = dynamics or default_dynamics()
    if sequences is not None and (not np.isfinite(sequences) or sequences <= 0):
        raise ValueError(f"sequences must be a number > 0 (sequences per step) or None, got "
                         f"{sequences!r}")
    noise = np.sqrt(d.sequences / sequences) if sequences and d.sequences > 0 else 1.0
    rng = np.random.default_rng(seed)
    base = synthetic_loads(skew, seed, num_layers=num_layers, num_experts=num_experts,
                           num_groups=num_groups, top_k=top_k, tokens=tokens)
    log_base = np.log(np.maximum(base, 0.5))
    L, E = log_base.shape
    # Pull-back of the level so its stationary spread is level_band (OU: var = s^2 / (2 theta)).
    theta = min(1.0, d.sigma_drift ** 2 / (2 * d.level_band ** 2)) if d.level_band > 0 else 1.0
    u = np.zeros((L, E))
    sigma_step = d.sigma_step * noise
    r = rng.standard_normal((L, E)) * sigma_step
    innovation = sigma_step * np.sqrt(max(1.0 - d.rho ** 2, 0.0))
    pairs = tokens * top_k
    out = np.empty((steps, L, E))
    for t in range(steps):
        u = (1 - theta) * u + d.sigma_drift * rng.standard_normal((L, E))
        r = d.rho * r + innovation * rng.standard_normal((L, E))
        bursts = rng.random((L, E)) < d.burst_rate
        spike = bursts * rng.choice([-1.0, 1.0], size=(L, E)) * d.burst_size * sigma_step
        z = log_base + u + r + spike
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p = cap_shares(p / p.sum(axis=1, keepdims=True), 1.0 / top_k)
        for layer in range(L):
            out[t, layer] = rng.multinomial(pairs, p[layer])
    return out


def read_trace(source: str) -> tuple[np.ndarray, str]:
    """(counts [T, L, E] float64, description) from a shipped trace name or a ``.npz``/``.npy``
    file whose array (``counts`` in an ``.npz``) is [steps, layers, experts]."""
    if source in trace_names():
        counts, meta = trace_loads(source)
        return counts, f"recorded {meta.get('model', source)}"
    path = Path(source)
    if path.suffix not in (".npz", ".npy"):
        raise ValueError(f"trace must be one of {trace_names()}, 'generated', or a .npz/.npy file "
                         f"of counts [steps, layers, experts], got {source!r}")
    try:
        if path.suffix == ".npy":
            counts = np.load(path, allow_pickle=False)
        else:
            with np.load(path, allow_pickle=False) as data:
                counts = np.asarray(data["counts"])
    except (OSError, KeyError, ValueError) as err:
        raise ValueError(f"cannot read trace {source!r} ({err}); an .npz needs an array 'counts' "
                         f"[steps, layers, experts]") from None
    if counts.ndim != 3 or min(counts.shape) < 1:
        raise ValueError(f"trace {source!r}: counts must be [steps, layers, experts], got shape "
                         f"{counts.shape}")
    if not np.issubdtype(counts.dtype, np.number) or not np.isfinite(counts).all() \
            or (counts < 0).any():
        raise ValueError(f"trace {source!r}: counts must be finite numbers >= 0")
    return counts.astype(np.float64), f"file {path.name}"
