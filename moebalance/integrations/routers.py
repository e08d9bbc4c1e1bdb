"""Finding the routers of a model and hooking them to a :class:`~moebalance.LoadTracker`.

Which modules count as routers:

* transformers 5.x MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, GPT-OSS and
  others built the same way): a child named ``gate`` or ``router`` of a module that also has an
  ``experts`` child. Its forward returns ``(router_logits [T,E], top_k_weights [T,K],
  top_k_index [T,K])`` and the hook records ``top_k_index`` -- the experts the model actually
  used. Top-k is never recomputed from the logits: DeepSeek-V3 chooses with a bias correction and
  group limits that the logits do not show.
* Llama 4's router (``TOPK_OF_LOGITS_ROUTERS``), which returns ``(scores, logits)`` and
  chooses ``torch.topk(logits, top_k)``: the hook takes that choice again from the logits.
  Its experts run every token, so :func:`moebalance.wrap` cannot serve them.
* any module whose class sets ``moebalance_router = True`` (moebalance's own
  ``ExpertParallelMoE`` router does). Such a router must return the same triple and have an
  integer attribute ``num_experts``.

:func:`moe_blocks` gives the transformers MoE blocks whose experts :func:`moebalance.wrap` can
make expert-parallel.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from torch import nn

from ..nn.slots import ExpertSlots
from ..tracker import _TRACKER_OF_ROUTER, LoadTracker

__all__ = ["find_routers", "attached_tracker", "attach", "moe_blocks", "ROUTER_CHILD_NAMES"]

# Names a transformers MoE block gives its router (GPT-OSS: "router", the others: "gate").
ROUTER_CHILD_NAMES = ("gate", "router")
# Routers that return (scores, logits) and choose torch.topk(logits, top_k), whose experts run
# every token (Llama 4): attach() counts that choice, taken again from the logits; wrap()
# cannot serve their experts.
TOPK_OF_LOGITS_ROUTERS = ("Llama4Router",)
# Config fields that hold the number of routed experts, by model family.
_CONFIG_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


def find_routers(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """The MoE routers of ``model`` in model order, as ``(module name, router, num_experts)``.

    Dense layers have no router and get no index, so index ``l`` is the l-th MoE layer.
    Raises ValueError when a transformers 4.x-style router (a bare ``nn.Linear`` gate, which
    returns logits only) is found, or when the expert count of a router cannot be told. A
    subclass of ``nn.Linear`` with its own forward (PhiMoE's top-k router) is a router like any
    other.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found = []
    seen: set[int] = set()
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if id(child) in seen:
                continue
            marked = getattr(type(child), "moebalance_router", False) is True
            structural = child_name in ROUTER_CHILD_NAMES and isinstance(
                getattr(parent, "experts", None), nn.Module)
            if not (marked or structural):
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if type(child) is nn.Linear and not marked:
                raise ValueError(
                    f"{name} is a plain nn.Linear gate (transformers 4.x layout) that returns "
                    f"logits only; attach() needs routers that return their chosen expert ids: "
                    "use transformers>=5, or call LoadTracker.record(layer, topk_ids) from your "
                    "own code"
                )
            if structural and not marked and not _takes_routed_tokens(parent.experts) \
                    and type(child).__name__ not in TOPK_OF_LOGITS_ROUTERS:
                raise ValueError(
                    f"{name} feeds experts that run every token for every expert (Llama 4's "
                    f"layout: {type(parent.experts).__name__}.forward(hidden)), and it returns no "
                    f"chosen expert ids to count; record them with LoadTracker.record(layer, "
                    f"topk_ids) from your own code")
            seen.add(id(child))
            found.append((name, child, _router_num_experts(name, child, model, marked)))
    return found


def _router_num_experts(name: str, router: nn.Module, model: nn.Module, marked: bool) -> int:
    num = getattr(router, "num_experts", None)
    if isinstance(num, int) and not isinstance(num, bool) and num > 0:
        return num
    if marked:
        raise ValueError(f"router {name} sets moebalance_router = True but has no positive "
                         "int num_experts")
    weight = getattr(router, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    config = getattr(model, "config", None)
    for field in _CONFIG_EXPERT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"cannot tell the number of experts of router {name}: give it a "
                     "num_experts attribute")


def attached_tracker(model: nn.Module) -> LoadTracker | None:
    """The attached tracker that records every router of ``model``, or None when there is none.

    Finds the tracker of :func:`moebalance.wrap` (or an earlier :func:`attach`) from any module
    that contains the model, e.g. a LightningModule holding it. Raises ValueError when the
    routers record into different trackers, or only some of them into one.
    """
    owners = set()
    for _, router, _ in find_routers(model):
        ref = _TRACKER_OF_ROUTER.get(router)
        tracker = ref() if ref is not None else None
        owners.add(tracker if tracker is not None and tracker.attached else None)
    if len(owners) > 1:
        raise ValueError(f"the routers of {type(model).__name__} record into {len(owners)} "
                         "different trackers (or some into none); detach() them and attach() one "
                         "to the model")
    return owners.pop() if owners else None


def attach(model: nn.Module, tracker: LoadTracker | None = None, *, window: int | None = None,
           ema: float | None = None) -> LoadTracker:
    """Hook every MoE router of ``model`` so that each forward records its chosen experts.

    Args:
        model: a transformers 5.x MoE model or any module holding moebalance routers (see the
            module docstring for what counts as a router).
        tracker: the tracker to record into; its num_layers / num_experts must match the
            routers found. None: a new one is made with ``window`` / ``ema``.
        window, ema: settings of the new tracker (only when ``tracker`` is None).

    Returns:
        The tracker, with ``layer_names`` (router module name per layer index) and ``detach()``.

    Forward passes recomputed during backward (activation checkpointing) are not recorded a
    second time. Raises ValueError when the model has no router, or when its routers already
    record into another attached tracker (detach that one first).
    """
    routers = find_routers(model)
    if not routers:
        raise ValueError(
            f"no MoE router found in {type(model).__name__}: attach() hooks children named "
            f"{' / '.join(ROUTER_CHILD_NAMES)} of modules with an `experts` child (transformers "
            f"5.x MoE blocks) and modules whose class sets moebalance_router = True"
        )
    experts = {num for _, _, num in routers}
    if len(experts) != 1:
        raise ValueError(
            f"the routers of this model have different expert counts {sorted(experts)}; "
            f"track such layers with separate LoadTrackers fed by record()"
        )
    num_experts = experts.pop()
    if tracker is None:
        tracker = LoadTracker(len(routers), num_experts, window=window, ema=ema)
    else:
        if not isinstance(tracker, LoadTracker):
            raise TypeError(f"tracker must be a LoadTracker, got {type(tracker).__name__}")
        if window is not None or ema is not None:
            raise ValueError("window/ema configure a new tracker; the tracker passed in already "
                             "has its own")
        if (tracker.num_layers, tracker.num_experts) != (len(routers), num_experts):
            raise ValueError(
                f"tracker has num_layers={tracker.num_layers}, num_experts={tracker.num_experts} "
                f"but the model has {len(routers)} MoE layers of {num_experts} experts; build it "
                f"as LoadTracker({len(routers)}, {num_experts}, ...)"
            )
        if tracker.attached:
            raise ValueError("tracker is already attached to a model; call tracker.detach() first")
    for name, router, _ in routers:
        owner = _TRACKER_OF_ROUTER.get(router)
        other = owner() if owner is not None else None
        if other is not None and other.attached:
            # mb.wrap(track=True) keeps its tracker on the model: name where to find it
            holder = next((f"{'model.' + n if n else 'model'}.moebalance_tracker"
                           for n, m in model.named_modules()
                           if getattr(m, "moebalance_tracker", None) is other), None)
            where = (f"mb.wrap attached it as {holder}: use that" if holder else
                     "attach() returned it")
            raise ValueError(
                f"router {name} of this model already records into a LoadTracker ({other!r}); a "
                f"second one would count every token again. Use that tracker ({where}; a "
                f"Rebalancer takes it as tracker=), or call its detach() before attaching "
                f"another"
            )
    for _, router, _ in routers:
        _TRACKER_OF_ROUTER[router] = weakref.ref(tracker)
    tracker.layer_names = [name for name, _, _ in routers]
    tracker._routers = [weakref.ref(router) for _, router, _ in routers]
    modules = dict(model.named_modules())
    tracker._hooks = [router.register_forward_hook(_make_hook(
                          tracker, layer, name,
                          _identity_experts(modules.get(name.rpartition(".")[0]))))
                      for layer, (name, router, _) in enumerate(routers)]
    return tracker


def _identity_experts(block) -> int:
    """Zero-computation experts of a block (LongCat-Flash's ``zero_expert_num``): ids past the
    routed experts that pass a token through unchanged, with no slot and no compute."""
    zero = getattr(block, "zero_expert_num", 0)
    return zero if isinstance(zero, int) and not isinstance(zero, bool) and zero > 0 else 0


def _make_hook(tracker: LoadTracker, layer: int, name: str, identity: int = 0):
    def record_router_choice(module, args, output):
        # A forward replayed inside backward (activation checkpointing) was already counted.
        if torch._C._current_graph_task_id() != -1:
            return
        if type(module).__name__ in TOPK_OF_LOGITS_ROUTERS and isinstance(output, tuple) \
                and len(output) == 2:
            # its own choice, made again on the same logits: top_k of router_logits [T, E]
            tracker.record(layer, torch.topk(output[1], module.top_k, dim=-1).indices)
            return
        if not (isinstance(output, (tuple, list)) and len(output) == 3
                and isinstance(output[2], torch.Tensor)):
            raise ValueError(
                f"router {name} ({type(module).__name__}) returned {type(output).__name__}, not "
                "(router_logits, top_k_weights, top_k_index); attach() supports routers that "
                f"return that triple -- record other routers' ids with LoadTracker.record()"
            )
        ids = output[2]
        if identity:     # a token sent to an identity expert loads no slot: counted as dropped
            ids = torch.where(ids < tracker.num_experts, ids, -1)
        tracker.record(layer, ids)

    return record_router_choice


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(name, block, router) of every MoE block whose ``experts`` child holds fused 3D experts."""
    modules = dict(model.named_modules())
    blocks = []
    for router_name, router, _ in find_routers(model):
        block_name = router_name.rpartition(".")[0]
        block = modules.get(block_name)
        experts = getattr(block, "experts", None)
        if isinstance(experts, ExpertSlots):
            raise ValueError("this model is already wrapped; wrap() it once (unwrap() gives the "
                             "plain model back)")
        if experts is not None and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
            if not _takes_routed_tokens(experts):
                raise ValueError(
                    f"{block_name}.experts ({type(experts).__name__}) is called on every token "
                    f"for every expert, not as experts(hidden, top_k_index, top_k_weights) "
                    f"(Llama 4's layout); wrap() serves the blocks that route tokens (Mixtral, "
                    f"Qwen, OLMoE, DeepSeek, GPT-OSS and alike) -- track this model's loads with "
                    f"mb.attach(model) and plan with mb.plan()")
            blocks.append((block_name, block, router))
    return blocks


def _takes_routed_tokens(experts: nn.Module) -> bool:
    """Whether ``experts.forward`` takes ``(hidden, top_k_index, top_k_weights)``."""
    try:
        params = list(inspect.signature(experts.forward).parameters.values())
    except (TypeError, ValueError):
        return True          # no signature to read: the first forward will tell
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 3
