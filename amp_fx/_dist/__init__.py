"""amp_fx under ``torch.distributed``: DDP and FSDP2 (``fully_shard``).

* :mod:`amp_fx._dist.capture`: how :func:`amp_fx.compile` captures graphs of a model wrapped in
  ``DistributedDataParallel`` or sharded with ``fully_shard`` (their hooks run eagerly, the
  forwards they wrap are compiled).
* :mod:`amp_fx._dist.found_inf`: the gradient scaler's inf/NaN flag, combined across ranks when
  gradients are sharded (DTensor), in one collective on the device.
* :mod:`amp_fx._dist.lend`: an FSDP2 model lent to the inspection tools (it refuses deep copies),
  and put back as it was: buffers, gradients, FSDP2's sharding.
"""
