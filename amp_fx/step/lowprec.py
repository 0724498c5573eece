"""bf16 training state for a compiled step: ``compile_step(..., train_state="bf16_sr" | "bf16_kahan")``.

A mixed-precision step holds, per parameter, an fp32 weight, an fp32 gradient and two fp32 Adam
moments: 16 bytes. With ``train_state`` the parameters, their gradients and both moments are
bf16: 8 bytes, 10 with Kahan's compensation buffer. What keeps bf16 weights training like fp32
master weights is how the update is written back, not the storage:

* a bf16 weight updated with round-to-nearest loses every update smaller than half its ulp
  (2^-9 of the weight): late in training, with a small learning rate, most of them, and the run
  stalls (llm.c, optimi and torchao all report it; ``bench/bench_lowprec.py`` measures it);
* ``BF16_SR`` rounds the fp32 result up or down at random, with the probability that makes the
  rounding unbiased (:func:`round_bf16_stochastic`, torchao's ``_fp32_to_bf16_sr`` bit for bit):
  small updates survive on average;
* ``BF16_KAHAN`` keeps the rounding error of each write in a bf16 buffer and adds it to the next
  update (optimi's ``kahan_sum``): deterministic, 2 bytes more per parameter.

The update itself is Adam's, computed in fp32 from the bf16 state (:func:`_adam_fp32`, torchao's
``single_param_adam`` line for line: the moments stored back rounded to nearest); it reads the
optimizer's param_groups and keeps its state in ``optimizer.state`` (``exp_avg``, ``exp_avg_sq``,
``step`` and, for Kahan, ``kahan_comp``), so ``state_dict()`` and the compiled step's masked
restore see it. It replaces the optimizer's own step inside the compiled finish, and in the
eager paths (a scheduled hyperparameter other than lr), for ``torch.optim.Adam`` and ``AdamW``
without ``amsgrad``/``maximize``/``differentiable``; another optimizer is reported and trained with
its own state (:func:`unsupported`).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["TrainState", "LowPrecisionAdam", "round_bf16_stochastic", "unsupported"]


class TrainState(enum.Enum):
    """How bf16 parameters are written back after the fp32 update (``compile_step(train_state=)``)."""

    BF16_SR = "bf16_sr"
    BF16_KAHAN = "bf16_kahan"

    @classmethod
    def parse(cls, value: str | TrainState | None) -> TrainState | None:
        """``None``, a member or its value; anything else is a clear error."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            for member in cls:
                if member.value == value:
                    return member
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"amp_fx.compile_step: train_state must be None, {choices}; got {value!r}")


def round_bf16_stochastic(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` to bf16, rounded away from zero with probability (low 16 bits) / 2^16, else
    toward zero: E[result] = x exactly for every finite x whose bf16 neighbours are finite.

    torchao's ``_fp32_to_bf16_sr`` bit for bit (the same ``torch.randint`` draw from the default
    generator, so with the same seed and draw order the same bits); no host read. Inside a graph
    compiled by inductor the draw comes from inductor's own generator (``fallback_random=False``).
    """
    rand_16bit = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int32)
    bits = x.view(torch.int32)
    fraction = bits & 0xFFFF  # the low 16 bits that bf16 drops
    toward_zero = bits & 0xFFFF0000
    # +0x10000 is one bf16 ulp away from zero (sign-magnitude); rand < fraction has probability
    # fraction / 2^16
    rounded = torch.where(rand_16bit < fraction, toward_zero + 0x10000, toward_zero)
    return rounded.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


def unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the bf16 step cannot replace this optimizer's step (None: it can)."""
    kind = type(optimizer)
    if kind not in (torch.optim.Adam, torch.optim.AdamW):
        return f"{kind.__module__}.{kind.__qualname__} (only torch.optim.Adam and AdamW are supported)"
    for i, group in enumerate(optimizer.param_groups):
        for key in ("amsgrad", "maximize", "differentiable"):
            if group.get(key, False):
                return f"param_groups[{i}][{key!r}]=True (not supported)"
    return None


class LowPrecisionAdam:
    """Adam/AdamW on bf16 parameters and moments, written back with stochastic rounding or Kahan
    compensation. ``prepare`` turns the parameters and the state to bf16 (idempotent);
    ``step(optimizer)`` is the step function the compiled finish traces."""

    def __init__(self, mode: TrainState) -> None:
        self.mode = mode

    # ------------------------------------------------------------------ state
    def prepare(self, optimizer: torch.optim.Optimizer) -> None:
        """Turn every parameter of ``optimizer`` to bf16 in place (``p.data``: the Parameter
        objects the model and the optimizer hold stay the same) and create or convert its state,
        so that no step creates state (no warm-up, nothing to undo on the host)."""
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.dtype != torch.bfloat16:
                        p.data = p.data.to(torch.bfloat16)
                        if p.grad is not None:
                            p.grad = p.grad.to(torch.bfloat16)
                    self._prepare_state(optimizer.state[p], p)

    def _prepare_state(self, state: dict[str, Any], p: torch.Tensor) -> None:
        step = state.get("step")
        # on the parameter's device, as torchao's float32 counter: beta ** step in the graph
        # without a host tensor
        state["step"] = (
            torch.zeros((), dtype=torch.float32, device=p.device)
            if step is None
            else torch.as_tensor(step, dtype=torch.float32).to(p.device)
        )
        keys = ["exp_avg", "exp_avg_sq"] + (["kahan_comp"] if self.mode is TrainState.BF16_KAHAN else [])
        for key in keys:
            old = state.get(key)
            state[key] = (
                torch.zeros_like(p, dtype=torch.bfloat16)
                if old is None
                else old.to(device=p.device, dtype=torch.bfloat16)
            )

    # ------------------------------------------------------------------ the step
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """One Adam/AdamW step of every parameter with a gradient (traceable; reads no tensor
        value on the host). State missing for a parameter (one added after ``prepare``) is made."""
        decoupled_default = isinstance(optimizer, torch.optim.AdamW)
        with torch.no_grad():
            for group in optimizer.param_groups:
                beta1, beta2 = group["betas"]
                lr = group["lr"]
                if not isinstance(lr, torch.Tensor):  # torchao's float32 lr, for the same roundings
                    lr = torch.tensor(lr, dtype=torch.float32)
                decoupled = group.get("decoupled_weight_decay", decoupled_default)
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    state = optimizer.state[p]
                    if "exp_avg" not in state:
                        self._prepare_state(state, p)
                    state["step"] += 1
                    p32 = _adam_fp32(p, p.grad, state, lr, beta1, beta2, group["weight_decay"], group["eps"], decoupled)
                    if self.mode is TrainState.BF16_SR:
                        p.copy_(round_bf16_stochastic(p32))
                    else:
                        _write_kahan_(p, p32, state["kahan_comp"])

    @contextlib.contextmanager
    def as_optimizer_step(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Inside, ``optimizer.step()`` is this step and the optimizer does not skip on the device
        itself (so ``GradScaler.step`` masks it): for the eager paths of a compiled step."""
        own = vars(optimizer)
        saved = {k: own[k] for k in ("step", "_step_supports_amp_scaling") if k in own}

        def step(*args: Any, **kwargs: Any) -> None:
            self.step(optimizer)

        own["step"] = step
        own["_step_supports_amp_scaling"] = False
        try:
            yield
        finally:
            for key in ("step", "_step_supports_amp_scaling"):
                if key in saved:
                    own[key] = saved[key]
                else:
                    del own[key]


def _adam_fp32(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    lr: torch.Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    decoupled: bool,
) -> torch.Tensor:
    """The updated parameter in fp32 (not written); the moments updated in fp32 and stored back
    in their dtype. torchao's ``single_param_adam`` (amsgrad off) operation for operation, so
    that the roundings are the same."""
    step, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
    p_f32 = p.float()
    grad_f32 = grad.float()
    if decoupled:
        p_f32 = p_f32 - lr * weight_decay * p_f32
    else:
        grad_f32 = grad_f32 + weight_decay * p_f32
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    exp_avg_f32 = exp_avg.float().lerp(grad_f32, 1 - beta1)
    exp_avg_sq_f32 = exp_avg_sq.float().lerp(grad_f32.square(), 1 - beta2)
    exp_avg.copy_(exp_avg_f32)
    exp_avg_sq.copy_(exp_avg_sq_f32)
    denom = (exp_avg_sq_f32.sqrt() / bias_correction2.sqrt()) + eps
    return p_f32 - lr * (exp_avg_f32 / bias_correction1) / denom


def _write_kahan_(p: torch.Tensor, p32_new: torch.Tensor, comp: torch.Tensor) -> None:
    """Write ``p32_new`` into bf16 ``p`` with Kahan compensation: the update plus the error the
    last write left (``comp``) is added, and the error of this write is kept for the next."""
    p32 = p.float()
    update = comp.float() + (p32_new - p32)
    written = (p32 + update).to(torch.bfloat16)
    comp.copy_(update - (written.float() - p32))  # what this write lost; bf16 keeps 8 bits of it
    p.copy_(written)
