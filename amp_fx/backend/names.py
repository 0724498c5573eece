"""Names under the compiled root module for what a Dynamo frame reaches (modules, parameters).

Dynamo names modules and parameters by the expression that reaches them from the frame it compiles
(``L['self'].head``); the inspection tools, the policy's ``keep_fp32`` and every warning name them
as the root's ``named_modules()``/``named_parameters()`` do. The expression is evaluated against
the frame's real locals and the object it reaches is named by identity.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import types
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from amp_fx.passes.capture import source_name, source_text

__all__ = ["RootNames", "frame_self", "frame_self_name", "source_name"]


class RootNames:
    """Names under the compiled root module for the objects a Dynamo frame reaches.

    Dynamo names modules and parameters by the expression that reaches them from the frame it
    compiles (``L['self'].head``). The shape of that expression says nothing reliable: after a
    graph break inside a submodule the frame is the submodule's forward (``self`` is the
    submodule), and a decorator on ``forward`` (transformers 5.24 wraps ``LlamaForCausalLM.forward``
    in a ``functools.wraps`` wrapper taking ``*args``) makes the root ``L['args'][0]``. So every
    object is named by identity, as the root's ``named_modules()``/``named_parameters()`` name it:
    a module Dynamo records in ``nn_module_stack`` by its key (``str(id(module))``, or the key of
    the output graph's module table), else by the object its source expression reaches from the
    frame's real locals.
    """

    def __init__(self, root: torch.nn.Module | None) -> None:
        self.root = root
        self.scope: dict[str, Any] | None = None
        if root is None:
            return
        try:
            from torch._dynamo.symbolic_convert import InstructionTranslator

            tx = InstructionTranslator.current_tx()
            self.scope = {"__builtins__": {}, "L": tx.f_locals, "G": tx.f_globals, "getattr": getattr}
            own = frame_self(tx.f_code, tx.f_locals)
            self._keyed: dict[str, Any] = dict(getattr(tx.output, "nn_modules", None) or {})
        except Exception:  # not called from Dynamo (a test calling the backend directly)
            self.scope, own, self._keyed = None, None, {}
        self._modules: dict[int, str] = {}
        self._by_id: dict[int, torch.nn.Module] = {}
        for name, module in root.named_modules(remove_duplicate=False):  # a shared module: its first name
            self._modules.setdefault(id(module), name)
            self._by_id[id(module)] = module
        # The module the frame runs in: its own (its first argument, ``self``) when that is a
        # module of the root, else the innermost module of the root whose call is on the Python
        # stack below the frame. Dynamo records only the modules called inside the frame, so the
        # ops the frame runs itself would otherwise belong to no module: a graph break inside a
        # submodule (its resumed frame gets ``self`` only where the rest of ``forward`` uses it),
        # a function the submodule calls and Dynamo compiles as its own frame, a DDP/FSDP2 unit
        # compiled on its own.
        if isinstance(own, torch.nn.Module) and id(own) in self._modules:
            own_name: str | None = self._modules[id(own)]
        else:
            own = self._calling_module()
            own_name = self._shared_path(own) if own is not None else None
            own = root.get_submodule(own_name) if own_name else None
        self.frame_module = (own_name, type(own)) if own_name else None
        self._tensors = {
            id(t): n
            for n, t in (*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False))
        }
        self._objects: dict[str, object] = {}

    def _calling_module(self) -> torch.nn.Module | None:
        """The innermost module of the root that is running on this thread's Python stack (the
        frame Dynamo compiles runs inside its call): the first frame, from here outwards, whose
        first argument is one (``Module._call_impl(self, ...)``, a ``forward``)."""
        frame: types.FrameType | None = sys._getframe(1)
        while frame is not None:
            try:
                own = frame_self(frame.f_code, frame.f_locals)
            except Exception:  # noqa: BLE001 (a frame whose locals cannot be read: not a module's)
                own = None
            if isinstance(own, torch.nn.Module) and id(own) in self._modules:
                return own
            frame = frame.f_back
        return None

    def _shared_path(self, module: torch.nn.Module) -> str:
        """``module``'s name, or, where the root holds other modules of its type, the path all
        their names share (``layers`` for ``layers.0`` .. ``layers.5``): a graph captured in a call
        of one of them serves the same code in the others (the resumed ``forward`` of every layer),
        so only what they share is true of every run."""
        names = [name.split(".") for i, name in self._modules.items() if type(self._by_id[i]) is type(module)]
        return ".".join(os.path.commonprefix(names)) if len(names) > 1 else self._modules[id(module)]

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
        """``L['args'][0].layers.2``: Dynamo's paths are not always Python (an nn.Sequential's
        child is written ``.2``); walk them step by step (``.name``, ``[0]``, ``['key']``) from the
        frame's local or global."""
        match = re.match(r"([LG])\['([^']*)'\]", source)
        if match is None or self.scope is None:
            return None
        obj: object = self.scope[match.group(1)].get(match.group(2))
        rest = source[match.end() :]
        for step in re.finditer(r"\.(\w+)|\[(-?\d+)\]|\['([^']*)'\]|(.)", rest):
            attr, index, key, other = step.groups()
            if other is not None or obj is None:
                return None
            if attr is not None:
                obj = getattr(obj, attr, None)
            elif index is not None:
                try:
                    obj = obj[int(index)]  # type: ignore[index]  # a container the path was built from
                except Exception:
                    obj = getattr(obj, index, None)  # ``[0]`` of a ModuleList written as an index
            else:
                try:
                    obj = obj[key]  # type: ignore[index]  # a container the path was built from
                except Exception:
                    obj = getattr(obj, key, None)
        return obj

    def _keyed_module(self, key: object, mtype: object) -> torch.nn.Module | None:
        """The module an ``nn_module_stack`` key stands for, by identity: Dynamo keys a module it
        inlines by ``str(id(module))`` (``@n`` appended for its n-th call) and a module it keeps as a
        ``call_module`` by its key in the output graph's module table. None where the key names
        no module of the root of that type."""
        if not isinstance(key, str):
            return None
        base = key.split("@")[0]
        module = self._by_id.get(int(base)) if base.isdigit() else self._keyed.get(base)
        if module is None or id(module) not in self._modules or type(module) is not mtype:
            return None
        return module

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
                module = self._keyed_module(key, value[1])
                if module is not None:
                    name: str | None = self._modules[id(module)]
                else:
                    name = self._resolve(value[0], self._modules) if isinstance(value[0], str) else None
                renamed[key] = (name, *value[1:]) if name is not None else value
            node.meta["nn_module_stack"] = renamed

    def is_module_state(self, node: torch.fx.Node, value: Any) -> bool:
        """Whether a graph input is a parameter or buffer of the root (by identity)."""
        return self.root is not None and id(self.real_tensor(node, value)) in self._tensors

    def state_name(self, node: torch.fx.Node, value: Any) -> str | None:
        """The name under the root of the parameter or buffer a graph input is (by identity), else
        None: right whatever Dynamo's source calls the root (``L['self']``, or ``L['args'][0]``
        under a decorator on ``forward``, as transformers 5.24's)."""
        return self.tensor_name(self.real_tensor(node, value))

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


def frame_self(code: Any, f_locals: dict[str, Any]) -> object:
    """The object a Dynamo frame runs for: its first argument (``self``), or the first of its
    ``*args`` when it has no named one (a decorator's ``wrapper(*args, **kwargs)`` around a
    ``forward``, as transformers 5.24 writes); None where it has neither."""
    code = original_code(code)
    if code.co_argcount:
        return f_locals.get(code.co_varnames[0])
    if code.co_flags & inspect.CO_VARARGS:
        varargs = f_locals.get(code.co_varnames[code.co_kwonlyargcount])
        if isinstance(varargs, tuple) and varargs:
            return varargs[0]
    return None


def frame_self_name(code: Any) -> str | None:
    """The name of the first argument (``self``) of the function a Dynamo frame belongs to."""
    code = original_code(code)
    return code.co_varnames[0] if code.co_argcount else None


def original_code(code: Any) -> Any:
    """The code of the function a Dynamo frame belongs to.

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
    return code
