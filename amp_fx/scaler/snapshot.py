"""The masked step: copy an optimizer's parameters and state, step, put back where non-finite.

One implementation for ``GradScaler(step_mode=StepMode.MASKED)`` (eager, :class:`Snapshot`,
which also checks that the step can be undone on the device) and for ``compile_step``'s finish
graph (:func:`copy_state` and :func:`restore_where_`, traced by Dynamo): both copy with
``clone()`` and select with ``torch.where(found_inf != 0, old, new, out=new)``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["STATE_CREATED", "Snapshot", "copy_state", "creates_state", "restore_where_", "same_value", "unique_params"]

# Why a step could not be undone on the device, when the optimizer created its state.
STATE_CREATED = "optimizer state was created"

# Per parameter: None if it had no optimizer state, else {key: (live object, saved copy)}.
SavedState = list[dict[str, tuple[Any, Any]] | None]


def unique_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in param_group order, each once."""
    seen: set[int] = set()
    params: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def creates_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's next step may create state: some parameter with a gradient has none.

    The one warm-up test: ``GradScaler`` decides a self-scaling optimizer's first step on the host
    while it holds (a skipped first step cannot be undone on the device: torch's fused SGD would
    even keep uninitialised momentum buffers), and ``compile_step`` runs its eager warm-up while it
    holds. A checkpoint-loaded optimizer has state, so it pays neither.
    """
    state = optimizer.state
    return any(p.grad is not None and not state.get(p) for p in unique_params(optimizer))


def copy_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], SavedState]:
    """Clones of ``params`` and of every tensor in their optimizer state (call under no_grad)."""
    saved_params = [p.detach().clone() for p in params]
    state: SavedState = []
    for p in params:
        entry = optimizer.state.get(p)  # .get: the defaultdict must not grow here
        if entry is None:
            state.append(None)
            continue
        state.append({k: (v, v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()})
    return saved_params, state


def restore_where_(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    saved_params: list[torch.Tensor],
    state: SavedState,
    found_inf: torch.Tensor,
) -> None:
    """Put back the saved values where ``found_inf`` is non-zero, on the device, in place.

    A state key the optimizer rebound to a new tensor of the same kind is rebound to the
    selection. Non-tensor state is left alone (``Snapshot.needs_host_decision`` detects it).
    """
    skip = found_inf != 0
    masks: dict[torch.device, torch.Tensor] = {skip.device: skip}

    def mask(device: torch.device) -> torch.Tensor:
        if device not in masks:
            masks[device] = skip.to(device=device, non_blocking=True)
        return masks[device]

    for p, old in zip(params, saved_params):
        torch.where(mask(p.device), old, p, out=p)
    for p, before in zip(params, state):
        if before is None:
            continue
        entry = optimizer.state[p]
        for k, (live, old) in before.items():
            if not isinstance(live, torch.Tensor):
                continue
            now = entry[k]
            if now is live:
                torch.where(mask(now.device), old, now, out=now)
            else:  # the optimizer rebound the key to a new tensor of the same kind
                entry[k] = torch.where(mask(now.device), old, now)


def same_value(before: Any, after: Any) -> bool:
    """Whether a non-tensor state value is unchanged, without reading any tensor's value.

    Identity first (an untouched entry), then equality for plain scalars and tuples of them
    (``state["step"] += 1`` on a Python int rebinds it). A mutable object changed in place
    keeps its identity and is not detected.
    """
    if before is after:
        return True
    if isinstance(before, (tuple, list)) and isinstance(after, (tuple, list)):
        return len(before) == len(after) and all(map(same_value, before, after))
    scalars = (bool, int, float, complex, str, type(None))
    return isinstance(before, scalars) and isinstance(after, scalars) and before == after


class Snapshot:
    """Copies of an optimizer's parameters and state, to undo a step on the device.

    Holds one clone of every parameter in ``optimizer.param_groups`` and of every tensor in
    ``optimizer.state`` for them; that is the memory cost of ``StepMode.MASKED``.
    Structure (which state entries exist, non-tensor values, param-group hyperparameters)
    is recorded too: a step that changes it cannot be undone on the device and needs the
    flag on the host.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.params = unique_params(optimizer)
        with torch.no_grad():
            self.saved_params, self.state = copy_state(optimizer, self.params)
        self.groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]

    def needs_host_decision(self) -> str | None:
        """Why the step just taken cannot be undone on the device, or None if it can."""
        opt = self.optimizer
        for p, before in zip(self.params, self.state):
            after = opt.state.get(p)
            if before is None:
                if after:
                    return STATE_CREATED
                continue
            if after is None or after.keys() != before.keys():
                return "optimizer state keys changed"
            for k, (live, _) in before.items():
                now = after[k]
                if isinstance(live, torch.Tensor):
                    if not isinstance(now, torch.Tensor) or (
                        now is not live and (now.shape, now.dtype, now.device) != (live.shape, live.dtype, live.device)
                    ):
                        return f"state tensor {k!r} was replaced by one of another kind"
                elif not same_value(live, now):
                    return f"non-tensor state {k!r} changed ({live!r} -> {now!r})"
        for g, before_g in zip(opt.param_groups, self.groups):
            for k, v in before_g.items():
                if k not in g or not same_value(v, g[k]):
                    return f"param_group entry {k!r} changed"
        return None

    def restore_where(self, found_inf: torch.Tensor) -> None:
        """Put back the saved values where ``found_inf`` is non-zero, on the device."""
        with torch.no_grad():
            restore_where_(self.optimizer, self.params, self.saved_params, self.state, found_inf)

    def restore_all(self) -> None:
        """Undo the step completely (after the flag was read on the host)."""
        state = self.optimizer.state
        with torch.no_grad():
            for p, old in zip(self.params, self.saved_params):
                p.copy_(old)
            for p, before in zip(self.params, self.state):
                if before is None:
                    state.pop(p, None)
                    continue
                entry = state[p]
                entry.clear()
                for k, (live, old) in before.items():
                    if isinstance(live, torch.Tensor):
                        live.copy_(old)
                    entry[k] = live
        for g, before_g in zip(self.optimizer.param_groups, self.groups):
            g.update(before_g)
