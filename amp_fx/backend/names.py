"""Names under the compiled root module for what a Dynamo frame reaches (modules, parameters).

Dynamo names modules and parameters by the expression that reaches them from the frame it compiles
(``L['self'].head``); the inspection tools, the policy's ``keep_fp32`` and every warning name them
as the root's ``named_modules()``/``named_parameters()`` do. The expression is evaluated against
the frame's real locals and the object it reaches is named by identity.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from amp_fx.passes.capture import source_name, source_text

__all__ = ["RootNames", "frame_self_name", "source_name"]


class RootNames:
    """Names under the compiled root module for the objects a Dynamo frame reaches.

    Dynamo names modules and parameters by the expression that reaches them from the frame it
    compiles (``L['self'].head``). That frame is not always the root's: after a graph break inside
    a submodule, Dynamo compiles the submodule's forward as a frame of its own, whose ``self`` is
    the submodule. The expression is evaluated against the frame's real locals, and the object it
    reaches is named by identity, as the root's ``named_modules()``/``named_parameters()`` name it.
    """

    def __init__(self, root: torch.nn.Module | None) -> None:
        self.root = root
        self.scope: dict[str, Any] | None = None
        if root is None:
            return
        try:
            from torch._dynamo.symbolic_convert import InstructionTranslator

            tx = InstructionTranslator.current_tx()
            self.scope = {"__builtins__": {}, "L": tx.f_locals, "G": tx.f_globals,
                          "getattr": getattr}
            first = frame_self_name(tx.f_code)
        except Exception:  # not called from Dynamo (a test calling the backend directly)
            self.scope, first = None, None
        self._modules = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
        # The frame's own module (its first argument, ``self``) when it is a submodule of the
        # root: Dynamo records only the modules called inside the frame, so the ops the frame runs
        # itself would otherwise belong to no module (a graph break inside a submodule, or a
        # DDP/FSDP2 unit compiled on its own).
        own = self.scope["L"].get(first) if self.scope is not None and first else None
        own_name = self._modules.get(id(own)) if isinstance(own, torch.nn.Module) else None
        self.frame_module = (own_name, type(own)) if own_name else None
        self._tensors = {id(t): n for n, t in (*root.named_parameters(remove_duplicate=False),
                                              *root.named_buffers(remove_duplicate=False))}
        self._objects: dict[str, object] = {}

    def _object(self, source: str) -> object | None:
        """The object Dynamo's source expression reaches from the frame's locals (cached)."""
        if self.scope is None:
            return None
        if source not in self._objects:
            try:
                obj = eval(source, self.scope)  # noqa: S307 - Dynamo's own source expression
            except Exception:
                obj = self._walk(source)
            self._objects[source] = obj
        return self._objects[source]

    def _resolve(self, source: str, table: dict[int, str]) -> str | None:
        obj = self._object(source)
        return table.get(id(obj)) if obj is not None else None

    def _walk(self, source: str) -> object | None:
        """``L['module'].2``: Dynamo's module paths are not always Python (an nn.Sequential's
        child is written ``.2``); walk them attribute by attribute from the frame's local."""
        match = re.fullmatch(r"L\['(\w+)'\]((?:\.\w+)*)", source)
        if match is None or self.scope is None:
            return None
        obj = self.scope["L"].get(match.group(1))
        for part in filter(None, match.group(2).split(".")):
            obj = getattr(obj, part, None)
        return obj

    def rename_module_stacks(self, gm: torch.fx.GraphModule) -> None:
        """Rewrite each node's ``nn_module_stack`` sources to names under the root, where found."""
        if self.scope is None:
            return
        for node in gm.graph.nodes:
            stack = node.meta.get("nn_module_stack")
            if self.frame_module is not None and node.op in ("call_function", "call_method", "call_module"):
                stack = {"amp_fx_frame_module": self.frame_module, **(stack or {})}
            if not stack:
                continue
            renamed = {}
            for key, value in stack.items():
                name = self._resolve(value[0], self._modules) if isinstance(value[0], str) else None
                renamed[key] = (name, *value[1:]) if name is not None else value
            node.meta["nn_module_stack"] = renamed

    def tensor_name(self, tensor: object) -> str | None:
        return self._tensors.get(id(tensor)) if self.root is not None else None

    def real_tensor(self, node: torch.fx.Node, value: Any) -> Any:
        """The tensor a graph input stands for: ``value`` itself, unless it is a fake tensor.

        Dynamo hands the backend the real parameters, but its DDPOptimizer runs each piece of a
        split graph on fake tensors, and a fake tensor is made anew for each compile: the real one
        is what the placeholder's Dynamo source (``L['self']._modules['fc']._parameters['weight']``)
        reaches from the frame's locals. Without a source or a frame, ``value``.
        """
        if not isinstance(value, FakeTensor) or self.scope is None:
            return value
        source = source_text(node)
        if not source:
            return value
        obj = self._object(source)
        return obj if isinstance(obj, torch.Tensor) and not isinstance(obj, FakeTensor) else value


def frame_self_name(code: Any) -> str | None:
    """The name of the first argument (``self``) of the function a Dynamo frame belongs to.

    A frame resumed after a graph break runs a generated function whose arguments are Dynamo's
    own first; its original code is found through Dynamo's resume-function metadata (a private
    table; when a torch version lacks it, the frame's own module is simply not added).
    """
    try:
        from torch._dynamo.resume_execution import ContinueExecutionCache

        meta = ContinueExecutionCache.generated_code_metadata
        for _ in range(8):  # resumed frames of resumed frames, bounded
            if code not in meta:
                break
            code = meta[code].code
    except Exception:
        pass
    return code.co_varnames[0] if code.co_argcount else None
