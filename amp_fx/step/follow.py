"""Following the optimizer between compiled steps.

What the user (or a scheduler) may change between two calls of a ``CompiledStep``, and what the
step does about it, all decided on the host from Python objects (no device read):

* hyperparameters (:meth:`OptimizerFollower.follow_hyperparameters`): a scheduled float ``lr``
  enters the compiled finish as a device tensor (:meth:`~OptimizerFollower.lrs_as_tensors`);
  any other changed hyperparameter makes the optimizer step eagerly from then on;
* param groups (:meth:`~OptimizerFollower.follow_param_groups`): parameters the optimizer
  gained or lost (progressive unfreezing);
* ``requires_grad`` changes torch 2.11's Dynamo does not see (:meth:`~OptimizerFollower.check_requires_grad`);
* the warm-up (:meth:`~OptimizerFollower.needs_warm_up`): until the optimizer has state for every
  parameter, the finish runs eagerly;
* the optimizer's step hooks, which the traced step does not run (torch's step wrapper is
  skipped): :meth:`~OptimizerFollower.run_pre_hooks` and :meth:`~OptimizerFollower.run_post_hooks`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from amp_fx._common import compat as _compat
from amp_fx._common.report import Reporter, warn
from amp_fx._dist.step import check_distributed_step
from amp_fx.scaler.snapshot import creates_state, same_value, unique_params

__all__ = ["OptimizerFollower", "check_params", "group_values"]

logger = logging.getLogger(__name__)


def group_values(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param_group's entries but its params (the objects, not copies)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def check_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's parameters must be the model's; trainable ones it lacks are a UserWarning."""
    model_params = {id(p) for p in model.parameters()}
    foreign = [i for i, p in enumerate(unique_params(optimizer)) if id(p) not in model_params]
    if foreign:
        raise ValueError(
            f"amp_fx.compile_step: the optimizer holds {len(foreign)} parameter(s) that are not "
            f"parameters of the model (positions {foreign[:5]} in its param_groups); build the "
            "optimizer on model.parameters()"
        )
    in_opt = {id(p) for p in unique_params(optimizer)}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_opt]
    if missing:
        # The user's own setup, not something amp_fx left undone: a UserWarning, never strict.
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        warn(
            f"amp_fx.compile_step: trainable parameters not in the optimizer keep accumulating "
            f"gradients (the step never zeroes them): {missing[:5]}{more}; add them to the "
            "optimizer or set requires_grad=False",
            UserWarning,
        )


class OptimizerFollower:
    """What a compiled step knows of its optimizer between steps (see the module docstring).

    ``params``: the optimizer's parameters as of the last step; ``expect_recompile``: the finish
    will recompile for something the step did itself (the first compile, a new lr tensor, new
    parameters), so that recompile is not reported; ``eager_optimizer``: a hyperparameter other
    than lr changed, the optimizer steps eagerly; ``warmed_up``: one eager step was taken.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        report: Reporter,
        *,
        fused: bool,
        fsdp2: bool,
        replaced_step: bool = False,
    ) -> None:
        self.model = model
        self.replaced_step = replaced_step  # compile_step's train_state: its Adam step replaces the optimizer's
        self.optimizer = optimizer
        self.report = report
        self.fused = fused
        self.fsdp2 = fsdp2
        self.params = unique_params(optimizer)
        self.expect_recompile = True
        self.eager_optimizer = False
        self.warmed_up = False
        self._seen_groups = group_values(optimizer)
        # Per param_group index: the device tensor that carries a scheduled float lr into the
        # compiled finish (filled from the float before each step).
        self._lr_tensors: dict[int, torch.Tensor] = {}
        # torch 2.11: the parameters' requires_grad as the forward last saw it (check_requires_grad)
        self._requires_grad: list[bool] | None = None

    def follow_hyperparameters(self) -> None:
        """React to hyperparameters that changed since the last step (an LR or momentum scheduler).

        Dynamo specialises the traced optimizer step on every float hyperparameter it reads, so
        each new value would recompile the finish (and, past Dynamo's recompile limit, fail).
        * A float ``lr`` that changed is carried into the compiled finish as a 0-dim float32
          device tensor from then on (every torch optimizer takes a tensor lr, as torch
          recommends for compiled optimizers; float32 because the kernels round a Python lr to
          it anyway, and a float64 lr makes the traced non-fused Adam read it on the host),
          filled from the float before each step; the param_group keeps the user's float.
          Constant float learning rates are left alone: they keep the eager optimizer's
          arithmetic (``add_(g, alpha=-lr)``).
        * Any other hyperparameter that changed (OneCycleLR's ``betas``/``momentum``) cannot be
          a tensor in every optimizer (SGD branches on ``momentum != 0``; foreach Adam refuses a
          tensor beta1), so the optimizer step then runs eagerly, masked by the scaler.
        Fused optimizers step eagerly anyway: nothing to do for them.
        """
        now = group_values(self.optimizer)
        before, self._seen_groups = self._seen_groups, now
        if self.fused or len(now) != len(before):
            return
        for i, (after_g, before_g) in enumerate(zip(now, before)):
            for key, value in after_g.items():
                if key not in before_g or same_value(before_g[key], value):
                    continue
                if key == "lr" and isinstance(value, float):
                    if i not in self._lr_tensors:
                        group = self.optimizer.param_groups[i]
                        device = group["params"][0].device if group["params"] else self.params[0].device
                        self._lr_tensors[i] = torch.zeros((), dtype=torch.float32, device=device)
                        self.expect_recompile = True
                        logger.info(
                            "amp_fx.compile_step: param_groups[%d]['lr'] changed (%s -> %s); the "
                            "compiled step takes it as a device tensor from now on, so that it "
                            "does not recompile for each value",
                            i,
                            before_g[key],
                            value,
                        )
                elif key == "lr" and isinstance(value, torch.Tensor) and value.dim() == 0:
                    # amp_fx.skip_aware: the lr became a device tensor, updated in place from now on
                    self.expect_recompile = True
                elif not self.eager_optimizer:
                    self.eager_optimizer = True
                    # A fused=True optimizer keeps its step out of the graph, but train_state's step
                    # replaces the optimizer's, fused or not: only a constant value helps then.
                    fused_hint = "" if self.replaced_step else " or use a fused=True optimizer"
                    self.report.did_less(
                        "hyperparameter changed",
                        f"amp_fx.compile_step: param_groups[{i}][{key!r}] changed between steps "
                        f"({before_g[key]!r} -> {value!r}), e.g. by a scheduler (OneCycleLR's "
                        f"cycle_momentum); the compiled graph would recompile for every value, so the "
                        f"{type(self.optimizer).__name__} step now runs eagerly (masked by the scaler: "
                        "no host sync, bitwise the eager recipe). To keep it compiled, keep "
                        f"{key!r} constant (e.g. OneCycleLR(..., cycle_momentum=False)){fused_hint}.",
                    )

    @contextlib.contextmanager
    def lrs_as_tensors(self) -> Iterator[None]:
        """Inside: scheduled float lrs are their device tensors; after: the user's floats again."""
        groups = self.optimizer.param_groups
        floats = {i: groups[i]["lr"] for i in self._lr_tensors}
        try:
            for i, t in self._lr_tensors.items():
                t.fill_(floats[i])  # a host-to-device write of a Python float: no sync
                groups[i]["lr"] = t
            yield
        finally:
            for i, lr in floats.items():
                groups[i]["lr"] = lr

    def needs_warm_up(self) -> bool:
        """Until one eager step was taken, while some parameter has no optimizer state
        (``amp_fx.scaler.snapshot.creates_state``, the scaler's own test).

        An optimizer that keeps no state (SGD without momentum) is warm after one step taken; a
        checkpoint-loaded one is warm from the start.
        """
        return not self.warmed_up and creates_state(self.optimizer)

    def check_requires_grad(self) -> None:
        """Report a parameter whose ``requires_grad`` changed where Dynamo would not recompile.

        torch 2.11's Dynamo guards no parameter's ``requires_grad`` (plain ``torch.compile``
        alike, ``amp_fx._common.compat.dynamo_guards_param_requires_grad``): a layer unfrozen after the
        first step would keep getting no gradient. Checked on the host before each micro-batch,
        only on such versions; reported once per change (strict mode: an error).
        """
        if _compat.dynamo_guards_param_requires_grad():
            return
        named = list(self.model.named_parameters())
        now = [p.requires_grad for _, p in named]
        before, self._requires_grad = self._requires_grad, now
        if before is None or len(before) != len(now) or before == now:
            return
        changed = [name for (name, _), a, b in zip(named, before, now) if a != b]
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        self.report.did_less(
            ("requires_grad changed", tuple(changed)),
            (
                f"amp_fx.compile_step: requires_grad changed for {changed[:5]}{more} since the step "
                f"compiled its forward, and Dynamo on this torch ({torch.__version__}) does not recompile "
                "for that (torch 2.11 guards no parameter's requires_grad; plain torch.compile alike): "
                "those parameters would keep their old gradient behaviour (an unfrozen layer gets no "
                "gradient). After changing requires_grad, call torch._dynamo.reset() and build a new "
                "compile_step (same model, optimizer and scaler), or use torch >= 2.13."
            ),
        )

    def follow_param_groups(self) -> bool:
        """Take on parameters the optimizer gained or lost since the last step; True if it did.

        ``optimizer.add_param_group`` between steps (progressive unfreezing) would otherwise leave
        the new parameters' gradients out of the unscale and the check while the traced step
        updates them: scaled gradients applied as they are. So the step's parameter list is
        rebuilt (and, by the caller, the finish's: its slots in the skip record, the weight
        cache's writer and the FSDP2 local view), the finish recompiles once (expected, not
        reported), and the next step warms up eagerly while the new parameters have no optimizer
        state, as the first one did. A host-side comparison of object identities.
        """
        params = unique_params(self.optimizer)
        if len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params)):
            return False
        check_params(self.model, self.optimizer)
        check_distributed_step(self.model, self.optimizer)
        logger.info(
            "amp_fx.compile_step: the optimizer's parameters changed (%d -> %d); the step "
            "follows them and recompiles its optimizer part once",
            len(self.params),
            len(params),
        )
        self.params = params
        self._seen_groups = group_values(self.optimizer)
        self.warmed_up = False
        self.expect_recompile = True
        return True

    def run_pre_hooks(self) -> None:
        """The optimizer's step pre-hooks (global, then its own), as ``optimizer.step()`` runs them;
        not for a fused optimizer on one device, whose ``optimizer.step()`` runs them itself."""
        if self.fused and not self.fsdp2:
            return
        from torch.optim.optimizer import _global_optimizer_pre_hooks

        opt = self.optimizer
        for hook in (*_global_optimizer_pre_hooks.values(), *opt._optimizer_step_pre_hooks.values()):
            if hook(opt, (), {}) is not None:
                raise RuntimeError(
                    "amp_fx.compile_step: optimizer step pre-hooks that change the step's arguments are not supported"
                )

    def run_post_hooks(self) -> None:
        """The optimizer's step post-hooks (its own, then global), and the mark an LR scheduler's
        wrapper reads, as ``optimizer.step()`` leaves them."""
        from torch.optim.optimizer import _global_optimizer_post_hooks

        opt = self.optimizer
        opt._opt_called = True  # type: ignore[attr-defined]  # what an LR scheduler's wrapper records
        for hook in (*opt._optimizer_step_post_hooks.values(), *_global_optimizer_post_hooks.values()):
            hook(opt, (), {})
