"""Per-expert token counts, gathered on the device while the model runs.

Shapes: L MoE layers, E logical experts per layer, T tokens, K experts chosen per token,
B = E + 2 count bins (the experts, dropped ids, invalid ids), V = E + 1 (the experts, invalid ids).

A :class:`LoadTracker` keeps its counts where the router's ids already live (GPU or CPU) and
updates them with ``index_add_`` only, so recording never waits on the host: no ``.item()``, no
``.cpu()``, no Python branch on a tensor's value. The host sees the counts only through
:meth:`LoadTracker.snapshot`, which reduces them over a process group and copies them out
asynchronously (pinned memory, ``non_blocking``) -- the one moment a caller chooses to wait.

:func:`moebalance.attach` (:mod:`moebalance.integrations.routers`) finds the routers of a
model and hooks them::

    tracker = moebalance.attach(model, window=100)   # or attach(model, LoadTracker(...))
    for batch in data:
        loss = model(**batch).loss; loss.backward(); opt.step()
        tracker.step()                                # close the step: window / EMA update
    loads_LE = tracker.snapshot()                     # np.ndarray [L, E], summed over ranks
    tracker.detach()

Ids outside ``[0, E)``: ``-1`` marks a dropped token (capacity-limited routers use it) and is
ignored. Any other out-of-range id is counted in a separate "invalid" bin instead of an expert,
so it can neither crash the device nor corrupt another expert's count; the next
:meth:`~LoadTracker.snapshot` raises ``ValueError`` naming the layer. Checking earlier would
need a host sync per step; ``LoadTracker(..., check=True)`` does exactly that, for debugging.
"""

from __future__ import annotations

import operator
import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ._check import positive_int
from .collective_errors import Attempt, GroupValueError, agree, collective_device

# The count buffers (None where the settings keep none): saved, restored and moved together.
_COUNTS = ("_live_LB", "_closed_LE", "_invalid_L", "_ring_WLE", "_ema_LE")

# Router module -> the tracker attach() hooked it for (kept here: detach() clears it): a second
# tracker on the same router would count every token twice over two trackers without a word. Weak
# both ways: it keeps neither alive.
_TRACKER_OF_ROUTER: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = (
    weakref.WeakKeyDictionary())


class LoadSnapshot:
    """Handle of an in-flight :meth:`LoadTracker.snapshot`; :meth:`wait` gives the loads.

    The device-to-host copy (and the all-reduce, when there is one) may still be running when
    the handle is returned; only :meth:`wait` blocks.
    """

    def __init__(self, loads_LV: torch.Tensor, work=None, event=None, layer_names=None,
                 nonfinite_G: torch.Tensor | None = None):
        self._loads_LV = loads_LV  # last column: invalid ids per layer
        self._nonfinite_G = nonfinite_G   # NaN/inf loads of each rank (a view of the same buffer)
        self._work = work
        self._event = event
        self._layer_names = layer_names
        self._result: np.ndarray | None = None

    def is_completed(self) -> bool:
        """True when :meth:`wait` would return without blocking."""
        if self._result is not None:
            return True
        if self._work is not None and not self._work.is_completed():
            return False
        return self._event is None or self._event.query()

    def wait(self) -> np.ndarray:
        """Block until the loads are on the host; return them as float64 [L, E].

        Raises ValueError if any rank recorded an expert id outside ``[-1, E)``, and
        GroupValueError (the same text on every rank) if any rank's loads held NaN or inf.
        """
        if self._result is None:
            if self._work is not None:
                self._work.wait()
            if self._event is not None:
                self._event.synchronize()
            if self._nonfinite_G is not None:
                bad = self._nonfinite_G.numpy()
                if np.any(bad > 0):
                    ranks = np.flatnonzero(bad > 0).tolist()
                    raise GroupValueError(
                        f"LoadTracker.snapshot: the tracked loads of rank(s) {ranks} hold "
                        f"{int(bad.sum())} NaN or inf values; reset() the tracker there or "
                        f"load a state_dict with finite counts", "LoadTracker.snapshot",
                        [(g, f"{int(bad[g])} non-finite loads") for g in ranks])
            host = self._loads_LV.numpy()
            invalid_L = host[:, -1]
            if np.any(invalid_L > 0):
                layer = int(np.flatnonzero(invalid_L > 0)[0])
                where = f" ({self._layer_names[layer]})" if self._layer_names else ""
                raise ValueError(
                    f"topk_ids recorded for layer {layer}{where} held {int(invalid_L[layer])} "
                    f"expert ids outside [-1, num_experts={host.shape[1] - 1}); check the router's "
                    "num_experts, or use LoadTracker(..., check=True) to fail at the "
                    "faulty record()"
                )
            self._result = np.ascontiguousarray(host[:, :-1])
        return self._result


class LoadTracker:
    """Token counts per (MoE layer, expert), kept on the device with no host sync per step.

    Three views of the load, chosen at construction:

    * cumulative (default): every id recorded since construction or :meth:`reset`, including
      the step still open;
    * ``window=W``: the sum of the last W closed steps (ring buffer on the device);
    * ``ema=a``: per closed step, ``ema_LE = a * ema_LE + (1 - a) * step_LE`` (the first closed
      step initialises it).

    A step is closed by :meth:`step`; until then its ids show in :meth:`counts` only.

    Args:
        num_layers: L, MoE layers tracked (layer indices 0..L-1 in model order).
        num_experts: E, routed experts per layer.
        window: keep the last ``window`` steps (int >= 1); excludes ``ema``.
        ema: smoothing factor in [0, 1); excludes ``window``.
        device: where the counts live. None: on the device of the first ids recorded.
        check: validate every ``record()`` on the host at once (raises ValueError at the faulty
            call). This synchronises with the device each call: for debugging only.
    """

    def __init__(self, num_layers: int, num_experts: int, *, window: int | None = None,
                 ema: float | None = None, device=None, check: bool = False):
        self.num_layers = positive_int(num_layers, "num_layers")
        self.num_experts = positive_int(num_experts, "num_experts")
        if window is not None and ema is not None:
            raise ValueError("pass window or ema, not both: a tracker keeps one view of the load")
        self.window = None if window is None else positive_int(window, "window")
        if ema is not None:
            if isinstance(ema, bool) or not isinstance(ema, (int, float, np.floating, np.integer)):
                raise TypeError(f"ema must be a float in [0, 1), got {type(ema).__name__}")
            if not 0.0 <= float(ema) < 1.0:
                raise ValueError(f"ema must be in [0, 1) (weight of the past), got {ema}")
            ema = float(ema)
        self.ema = ema
        if not isinstance(check, bool):
            raise TypeError(f"check must be a bool, got {type(check).__name__}")
        self.check = check
        #: Router module names, one per layer index, when built by :func:`attach`.
        self.layer_names: list[str] = []
        self._hooks: list = []
        self._routers: list[weakref.ref] = []      # the hooked router of each layer
        self._steps = 0
        self.device: torch.device | None = None
        # Counts restored by load_state_dict before anything was recorded sit on the CPU until
        # the first record() (or a snapshot) says where the router's ids are.
        self._restored_on_cpu = False
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError) as exc:
                raise ValueError("device must name a torch device such as 'cuda:0' or 'cpu', got "
                                 f"{device!r}") from exc
            self._allocate(device)

    # -- state ----------------------------------------------------------------------------------

    def _allocate(self, device: torch.device) -> None:
        L, E = self.num_layers, self.num_experts
        # Buffers must be ordinary tensors even when the first record() runs under
        # torch.inference_mode(), or later in-place updates during training would be refused.
        with torch.inference_mode(False), torch.no_grad():
            # Columns: E experts, then dropped (-1) ids, then invalid ids.
            self._live_LB = torch.zeros(L, E + 2, dtype=torch.int64, device=device)
            self._closed_LE = torch.zeros(L, E, dtype=torch.int64, device=device)  # cumulative view
            self._invalid_L = torch.zeros(L, dtype=torch.int64, device=device)  # closed steps
            self._ring_WLE = (torch.zeros(self.window, L, E, dtype=torch.int64, device=device)
                              if self.window is not None else None)
            self._ema_LE = (torch.zeros(L, E, dtype=torch.float64, device=device)
                            if self.ema is not None else None)
        # The buffers' own device: "cuda" names cuda:<current>, and a tensor's device is never
        # the bare "cuda" that record() compares against.
        self.device = self._live_LB.device

    @property
    def steps(self) -> int:
        """Steps closed by :meth:`step` since construction or :meth:`reset`."""
        return self._steps

    def reset(self) -> None:
        """Forget every count (hooks stay attached)."""
        self._steps = 0
        if self.device is not None:
            self._allocate(self.device)

    # -- per-step path (no host sync) -----------------------------------------------------------

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Add the experts chosen for ``T`` tokens in MoE layer ``layer``.

        Args:
            layer: MoE layer index in [0, L).
            topk_ids: [T, K] integer tensor (any integer dtype, CPU or CUDA) of expert ids;
                ``-1`` entries (dropped tokens) are ignored.

        Only shapes and dtypes are read on the host; the counting is one ``index_add_`` on the
        ids' device.
        """
        if isinstance(layer, (bool, torch.Tensor)):
            raise TypeError(f"layer must be a Python int, got {type(layer).__name__}")
        try:
            layer = operator.index(layer)
        except TypeError:
            raise TypeError(f"layer must be an int, got {type(layer).__name__}") from None
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, num_layers={self.num_layers}), got {layer}")
        if not isinstance(topk_ids, torch.Tensor):
            raise TypeError("topk_ids must be a torch.Tensor [T, K], got "
                            f"{type(topk_ids).__name__}")
        if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex \
                or topk_ids.dtype == torch.bool:
            raise TypeError(
                f"topk_ids must hold integer expert ids, got dtype {topk_ids.dtype} "
                f"(pass the router's top-k indices, not its logits or weights)"
            )
        if topk_ids.dim() != 2:
            raise ValueError(
                f"topk_ids must have shape [num_tokens, top_k], got {tuple(topk_ids.shape)}; "
                f"reshape it with topk_ids.reshape(-1, top_k)"
            )
        if self.device is None:
            self._allocate(topk_ids.device)
        elif self._restored_on_cpu:
            self._move_to(topk_ids.device)          # and the counts stay there from now on
        elif topk_ids.device != self.device:
            raise ValueError(
                f"topk_ids is on {topk_ids.device} but the tracker counts on {self.device}; "
                "record ids from the device the tracker was created on (or create it "
                "with device=None)"
            )
        E = self.num_experts
        with torch.no_grad():
            ids_N = topk_ids.reshape(-1).to(torch.int64)
            in_range = (ids_N >= 0) & (ids_N < E)
            # -1 -> column E (dropped), any other out-of-range id -> column E+1 (invalid).
            bin_N = torch.where(in_range, ids_N, torch.where(ids_N == -1, E, E + 1))
            self._live_LB[layer].index_add_(0, bin_N, torch.ones_like(bin_N))
            if self.check:
                bad = int((~in_range & (ids_N != -1)).sum())  # host sync: debugging mode only
                if bad:
                    raise ValueError(
                        f"topk_ids for layer {layer} held {bad} expert ids outside [-1, {E}); "
                        f"the router and the tracker disagree on num_experts"
                    )

    def counts(self) -> torch.Tensor:
        """Counts of the step still open: int64 [L, E] on the tracker's device.

        A live view: later ``record()`` calls add to it and ``step()`` zeroes it; ``clone()`` it
        to keep a value.
        """
        self._require_device()
        return self._live_LB[:, : self.num_experts]

    def step(self) -> torch.Tensor:
        """Close the current step: fold its counts into the window / EMA / cumulative view.

        Returns:
            int64 [L, E] on the tracker's device: the counts of the step just closed (a new
            tensor the tracker no longer writes to; move it to the host only when needed).
        """
        self._require_device()
        E = self.num_experts
        with torch.no_grad():
            live_LB = self._live_LB
            step_LE = live_LB[:, :E].clone()
            self._invalid_L += live_LB[:, E + 1]
            self._closed_LE += step_LE
            if self._ring_WLE is not None:
                self._ring_WLE[self._steps % self.window].copy_(step_LE)
            if self._ema_LE is not None:
                if self._steps == 0:
                    self._ema_LE.copy_(step_LE)
                else:
                    self._ema_LE.mul_(self.ema).add_(step_LE, alpha=1.0 - self.ema)
            live_LB.zero_()
        self._steps += 1
        return step_LE

    def _require_device(self) -> None:
        if self.device is None:
            raise ValueError(
                "the tracker holds no counts yet: record() some ids first, or create it "
                "with device=..."
            )

    # -- host side --------------------------------------------------------------------------------

    def loads(self) -> torch.Tensor:
        """The tracked load on the device, float64 [L, E]: window sum, EMA or cumulative counts."""
        self._require_device()
        with torch.no_grad():
            if self._ring_WLE is not None:
                return self._ring_WLE.sum(0).to(torch.float64)
            if self._ema_LE is not None:
                return self._ema_LE.clone()
            return (self._closed_LE + self._live_LB[:, : self.num_experts]).to(torch.float64)

    def snapshot(self, group=None, async_op: bool = False):
        """The tracked load summed over the ranks of ``group``, copied to the host.

        Every rank of ``group`` must call it (it is an all-reduce). Without an initialised
        torch.distributed (or with one rank) the local load is returned.

        Args:
            group: torch.distributed process group (None: the default group, when initialised).
            async_op: False: wait and return the loads. True: return a :class:`LoadSnapshot`
                at once; its ``wait()`` returns the loads. On CUDA the copy goes through pinned
                memory with ``non_blocking=True`` and an event, so the caller's stream never
                stalls; with NCCL the reduction is ordered on the stream the same way.

        Returns:
            float64 np.ndarray [L, E] (or a LoadSnapshot when ``async_op``). Raises ValueError
            (from ``wait()``) if any rank recorded expert ids outside ``[-1, E)``.
        """
        if not isinstance(async_op, bool):
            raise TypeError(f"async_op must be a bool, got {type(async_op).__name__}")
        distributed = (dist.is_available() and dist.is_initialized()
                       and dist.get_world_size(group) > 1)
        if self._restored_on_cpu and distributed:
            self._move_to(collective_device(group))     # where the peers' counts are
        if self.device is None:
            # Nothing recorded here yet: contribute zeros where the peers' counts are.
            device = collective_device(group) if distributed else torch.device("cpu")
            loads_LV = torch.zeros(self.num_layers, self.num_experts + 1, dtype=torch.float64,
                                   device=device)
        else:
            with torch.no_grad():
                invalid_L = (self._invalid_L
                             + self._live_LB[:, self.num_experts + 1]).to(torch.float64)
                loads_LV = torch.cat([self.loads(), invalid_L[:, None]], dim=1)
        work = nonfinite_G = None
        if distributed:
            # Trackers of another shape on one rank would meet in an all-reduce of mismatched
            # sizes: the ranks agree on L and E first (one all-reduce of a few host ints, once per
            # snapshot). NaN/inf loads are counted per rank in the reduce itself (no host sync).
            attempt = Attempt("LoadTracker.snapshot")
            agree(attempt, group, same={"tracker num_layers": self.num_layers,
                                        "tracker num_experts": self.num_experts})
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            with torch.no_grad():
                mine_G = loads_LV.new_zeros(world)
                mine_G[rank] = (~torch.isfinite(loads_LV)).sum()
                flat = torch.cat([loads_LV.reshape(-1), mine_G])
            work = dist.all_reduce(flat, group=group, async_op=True)
            loads_LV = flat[:-world].view(self.num_layers, self.num_experts + 1)
            nonfinite_G = flat[-world:]
        event = None
        if loads_LV.is_cuda:
            if work is not None:
                work.wait()  # NCCL: orders the copy after the reduction on the stream, host runs on
                work = None
            flat = loads_LV if nonfinite_G is None else torch.cat([loads_LV.reshape(-1),
                                                                    nonfinite_G])
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            # The copy runs on the loads' device's current stream, which need not be the
            # current device's: the event goes on that stream.
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(flat.device))
            L, E1 = self.num_layers, self.num_experts + 1
            loads_LV = host[:L * E1].view(L, E1)
            nonfinite_G = None if nonfinite_G is None else host[L * E1:]
        handle = LoadSnapshot(loads_LV, work=work, event=event,
                              layer_names=self.layer_names or None, nonfinite_G=nonfinite_G)
        return handle if async_op else handle.wait()

    def state_dict(self) -> dict:
        """Counts and settings as CPU tensors (for checkpoints). Syncs: call between steps."""
        state = {"num_layers": self.num_layers, "num_experts": self.num_experts,
                 "window": self.window, "ema": self.ema, "steps": self._steps}
        if self.device is not None:
            for name in _COUNTS:
                value = getattr(self, name)
                if value is not None:
                    state[name] = value.detach().cpu().clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output; the settings must match this tracker's."""
        for key in ("num_layers", "num_experts", "window", "ema"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"state {key}={state.get(key)!r} does not match this tracker's "
                    f"{key}={getattr(self, key)!r}; build the tracker with the settings it was "
                    "saved with"
                )
        self._steps = int(state["steps"])
        if "_live_LB" not in state:
            if self.device is not None:
                self._allocate(self.device)
            return
        self._restored_on_cpu = self.device is None
        self._allocate(self.device if self.device is not None else torch.device("cpu"))
        for name in _COUNTS:
            if getattr(self, name) is not None:
                getattr(self, name).copy_(state[name])

    def _move_to(self, device: torch.device) -> None:
        """Move the counts (restored on the CPU, nothing recorded since) to ``device``."""
        self._restored_on_cpu = False
        if torch.device(device) == self.device:
            return
        with torch.inference_mode(False), torch.no_grad():
            for name in _COUNTS:
                value = getattr(self, name)
                if value is not None:
                    setattr(self, name, value.to(device))
        self.device = self._live_LB.device

    # -- hooks ------------------------------------------------------------------------------------

    def detach(self) -> None:
        """Remove the router hooks installed by :func:`attach` (idempotent); counts are kept."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for router, owner in list(_TRACKER_OF_ROUTER.items()):
            if owner() is self:
                del _TRACKER_OF_ROUTER[router]

    def layer_of(self, router: nn.Module) -> int | None:
        """The layer index under which ``router`` records (names depend on the module that
        :func:`attach` was given; identity does not), or None when it is not hooked here."""
        for layer, ref in enumerate(self._routers):
            if self.attached and ref() is router:
                return layer
        return None

    @property
    def attached(self) -> bool:
        """True while router hooks installed by :func:`attach` are live."""
        return bool(self._hooks)

    def __repr__(self) -> str:
        view = (f"window={self.window}" if self.window is not None
                else f"ema={self.ema}" if self.ema is not None else "cumulative")
        return (f"LoadTracker(num_layers={self.num_layers}, num_experts={self.num_experts}, "
                f"{view}, device={self.device}, steps={self._steps}, attached={self.attached})")
