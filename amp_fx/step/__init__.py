"""``amp_fx.compile_step``: a whole mixed-precision training step, compiled, with no host sync.

    step = amp_fx.compile_step(model, optimizer, torch.nn.functional.cross_entropy, dtype="fp16")
    for x, y in loader:
        loss = step(x, y)          # forward, loss, scaled backward, unscale/check/clip, step, update

One call of the returned :class:`CompiledStep` runs three compiled pieces, stitched by Python
that reads no tensor value. The package holds them by phase:

* ``driver.py``: :func:`compile_step` (what it checks) and :class:`CompiledStep` (the call:
  micro-steps, forward and loss, backward, the end of a window).
* ``forward.py``: **forward + loss**, ``amp_fx.compile`` of ``loss_fn(model(*inputs), *targets)``
  (so the loss is computed under the same autocast policy as the model, as in torch's AMP
  recipe), returning the loss and the loss multiplied by the scale; one ``ForwardLoss`` for one
  device and for DDP/FSDP2 (``amp_fx._dist.step``). AOTAutograd compiles its backward. Keyword
  arguments of ``step`` go to the model. Graph breaks are allowed here (a logger call in a
  Hugging Face forward): each piece is compiled and rewritten.
* **backward**: ``scaled_loss.backward()`` runs AOTAutograd's compiled backward graph; the
  gradients accumulate into ``.grad`` as in eager.
* ``finish.py``: the **finish** (``torch.compile(fullgraph=True)``, once per accumulation
  window): the fused unscale + non-finite check, the clip, the optimizer step skipped on the
  device (masked inside the graph, or a ``fused=True`` optimizer's own kernel right after it), the
  scale update and the scaler's skip record.
* ``follow.py``: following the optimizer between steps (hyperparameters, param groups, scheduled
  learning rates as device tensors, the step hooks, ``requires_grad`` changes, the warm-up).
* ``shards.py``: FSDP2, the finish on each rank's local shards.

Why three pieces and not one graph: Dynamo graph-breaks on ``Tensor.backward()`` (torch 2.13:
"Unsupported Tensor.backward() call ... when trace_autograd_ops is off"), ``torch.optim``'s step
wrapper calls ``torch._dynamo.graph_break()`` and fused optimizers are ``compiler.disable``-d, so
``torch.compile`` of the whole recipe breaks 7 times (bench/bench_step.py prints the list).
Compiled autograd and the experimental ``torch._dynamo.config.trace_autograd_ops`` could put the
backward in the same graph; they were not measured for this version. The finish is a full
graph (``fullgraph=True``, so a break is an error, not a silent fallback); what matters
for CUDA graphs and throughput is that nothing between them reads the device, which this package
guarantees and ``tests/step/test_step.py`` proves with the profiler.

Warm-up: until every parameter of the optimizer has optimizer state (normally the first step),
the finish runs eagerly through ``amp_fx.GradScaler`` (``unscale_``, ``clip_grad_norm_``,
``step``, ``update``) which may read found_inf once on the host: a first step that creates
state cannot be undone on the device (torch's fused SGD would even leave its momentum buffers
uninitialised). From then on no step reads a device value on the host. The finish also runs
eagerly (masked by the scaler, still sync-free) once a hyperparameter other than ``lr`` changes
between steps (see ``OptimizerFollower.follow_hyperparameters``).

The loss-scale rules the finish applies (inverse scale and its guard, scale update, masked
restore) are ``amp_fx.scaler.rules`` and ``amp_fx.scaler.snapshot``: the same functions
``GradScaler`` calls. Each step compiles its own copy of its code objects, so it owns its
Dynamo cache entries.
"""

from amp_fx.step.driver import CompiledStep, compile_step
from amp_fx.step.finish import GradNorm

__all__ = ["compile_step", "CompiledStep", "GradNorm"]
