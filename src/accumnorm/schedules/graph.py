"""The model's forward as a torch.fx graph, so that the layerwise schedule can run all micro-batches on one thread.

The layerwise schedule must stop each micro-batch's forward at every BatchNorm call until all K have
reached it. Worker threads can do that for any Python, but each thread that runs torch ops on several
cores keeps an OpenMP team of its own, and on a machine with few cores the teams slow each other down.
When the model traces, the caller's thread instead walks the graph one node at a time, running each
node for micro-batch 0, 1, ..., K-1 before the next node, and every BatchNorm node once for all K: the
same autograd graph as the threads build, on the caller's own intra-op threads.

The trace uses torch.fx's rules, with every BatchNorm module a leaf (one node per BatchNorm call). A
graph replays the tensor operations of one Python run of the forward, so it is only used where it computes
what running the forward again would:
- every module the trace goes through (not a leaf, which runs as itself) comes from torch, torchvision,
  timm or accumnorm, or its class was declared `trace_safe`: a forward that keeps a counter, prints, or
  makes a choice in Python would do so once, at trace time;
- such a module has no hooks (the graph would skip them), and tracing changes no module attribute;
- the graph is traced with the call's non-tensor arguments fixed (fx's `concrete_args`) and traced again
  when they change, when a module is added, removed, hooked or switched between train and eval, or when
  a plain attribute of a module changes (a drop rate, a flag the forward branches on);
- a tracing error (data-dependent control flow, an argument that is a list of tensors) means no graph.
Without a graph the schedule runs the forward as Python in the worker threads, which is always right.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules import module as module_globals
from torch.nn.modules.batchnorm import _BatchNorm

from .step import GradModes

__all__ = ["ForwardGraph", "forward_graph", "give_up_graph", "trace_safe"]

_CONSTANTS = (type(None), bool, int, float, str)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_TRUSTED_LIBRARIES = ("torch.", "torchvision.", "timm.", "accumnorm.")
_trace_safe: set[type] = set()
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def trace_safe(cls: type[nn.Module]) -> type[nn.Module]:
    """Class decorator: the layerwise schedule may run this module's forward from a torch.fx graph.

    Declare it for a module of your own whose forward only computes on tensors: no counters, prints or
    logging, no random choices made in Python, and branches only on module attributes and on arguments
    that are not tensors. A model made of such modules and of torch, torchvision, timm and accumnorm ones
    then runs on the caller's thread (see `accumnorm.schedules.graph`); otherwise it runs in threads.

    Example::

        @accumnorm.trace_safe
        class Block(nn.Module):
            ...
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"trace_safe expects a subclass of torch.nn.Module, got {cls!r}")
    _trace_safe.add(cls)
    return cls


class _Tracer(fx.Tracer):
    """torch.fx's tracer with every BatchNorm module (torch's, subclasses, accumnorm's) a leaf, refusing what a
    graph of tensor operations would silently drop: a custom autograd.Function's backward (fx inlines its
    forward), and a switch of grad, inference or autocast mode inside the forward (fx records no modes)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, _BatchNorm) or super().is_leaf_module(m, module_qualified_name)

    def trace(self, root: nn.Module, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        self.modes = GradModes.current()
        own_apply = vars(torch.autograd.Function)["apply"]

        def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            if any(isinstance(a, fx.Proxy) for a in (*args, *kwargs.values())):
                raise fx.proxy.TraceError(f"the custom autograd.Function {cls.__name__} has a backward of its own")
            return own_apply.__func__(cls, *args, **kwargs)

        torch.autograd.Function.apply = classmethod(apply)
        try:
            return super().trace(root, concrete_args)
        finally:
            torch.autograd.Function.apply = own_apply

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        if GradModes.current() != self.modes:
            raise fx.proxy.TraceError("the forward switches grad, inference or autocast mode, which a graph does not "
                                      "record")
        return super().create_node(*args, **kwargs)


class ForwardGraph:
    """A traced forward that runs K calls in lockstep: `run(inputs, each, batch_norm, guarded)`."""

    def __init__(self, graph: fx.Graph, model: nn.Module, constants: dict[str, Any]) -> None:
        self.nodes = list(graph.nodes)
        self.constants = constants  # tensors the trace found in the forward (fx would store them on the model)
        self.model = weakref.ref(model)  # the cache holding this graph must not keep the model alive
        # Modules are looked up once: a module added, removed or replaced changes the key of the graph.
        self.modules = {n: model.get_submodule(n.target) for n in self.nodes if n.op == "call_module"}
        self.batch_norm = {n for n in self.nodes if _is_batch_norm(n, self.modules.get(n))}
        # A call of a function from outside torch (one of fx.wrap's) may hide a BatchNorm call; torch's leaf
        # modules, tensor methods and torch's and Python's own functions make none.
        self.opaque = {n for n in self.nodes if n.op == "call_function" and n not in self.batch_norm
                       and not _is_torch_or_python(n.target)}
        # Free each value after its last use, as fx.Interpreter does: the graph's own memory is one micro-batch's
        # activations per micro-batch, not every intermediate of the whole batch.
        self.frees: dict[fx.Node, list[fx.Node]] = {}
        seen: set[fx.Node] = set()
        for node in reversed(self.nodes):
            for used in node.all_input_nodes:
                if used not in seen:
                    seen.add(used)
                    self.frees.setdefault(node, []).append(used)

    def run(self, inputs: list[list[Any]], each: Callable[[int, Callable[[], Any]], Any],
            batch_norm: Callable[[list[Callable[[], Any]]], list[Any]],
            guarded: Callable[[], contextlib.AbstractContextManager]) -> list[Any]:
        """The forward's output for each of the K argument lists `inputs` (one value per placeholder).

        Every node but a BatchNorm one runs as `each(k, run_it)` for k = 0..K-1 in turn (the caller switches
        micro-batch k's random numbers in and out there), inside `guarded()` if it may hide a BatchNorm call; a
        BatchNorm node goes to `batch_norm([run_it, ...])` with the K calls, which returns their K outputs.
        """
        model = self.model()
        envs: list[dict[fx.Node, Any]] = [{} for _ in inputs]
        placeholders = 0
        for node in self.nodes:
            if node.op == "placeholder":
                for env, args in zip(envs, inputs):
                    env[node] = args[placeholders]
                placeholders += 1
            elif node.op == "output":
                return [fx.node.map_arg(node.args[0], env.__getitem__) for env in envs]
            elif node.op == "get_attr":
                value = self._attr(model, node.target)
                for env in envs:
                    env[node] = value
            else:
                runs = [self._runner(node, env) for env in envs]
                if node in self.batch_norm:
                    outputs = batch_norm(runs)
                else:
                    with guarded() if node in self.opaque else contextlib.nullcontext():
                        outputs = [each(k, run) for k, run in enumerate(runs)]
                for env, out in zip(envs, outputs):
                    env[node] = out
            for used in self.frees.get(node, ()):
                for env in envs:
                    del env[used]
        raise RuntimeError("the traced graph has no output node")

    def _attr(self, model: nn.Module, target: str) -> Any:
        if target in self.constants:
            return self.constants[target]
        value: Any = model
        for name in target.split("."):
            value = getattr(value, name)
        return value

    def _runner(self, node: fx.Node, env: dict[fx.Node, Any]) -> Callable[[], Any]:
        """A closure that runs `node` on one micro-batch's values."""
        def run() -> Any:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            if node.op == "call_module":
                return self.modules[node](*args, **kwargs)
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            return node.target(*args, **kwargs)
        return run


def _is_torch_or_python(function: Any) -> bool:
    module = getattr(function, "__module__", None) or ""
    return module in ("torch", "_operator", "builtins", "math") or module.startswith("torch.")


def _is_batch_norm(node: fx.Node, module: nn.Module | None) -> bool:
    if node.op == "call_module":
        return isinstance(module, _BatchNorm)
    return node.op == "call_function" and node.target is F.batch_norm


# model -> (the key it was traced under, its graph or why there is none)
_graphs: weakref.WeakKeyDictionary[nn.Module, tuple[Any, ForwardGraph | str]] = weakref.WeakKeyDictionary()


def forward_graph(model: nn.Module, calls: list[tuple[tuple, dict]]) -> tuple[ForwardGraph | str, list[list[Any]]]:
    """The graph of the model's forward for these K calls `(args, kwargs)` (or why there is none), and each call's
    values for its placeholders."""
    bound = [_bind(model, args, kwargs) for args, kwargs in calls]
    reason = next((b for b in bound if isinstance(b, str)), None)
    if reason is not None:
        return reason, []
    constants = tuple(bound[0][1].items())
    if any(tuple(concrete.items()) != constants for _, concrete in bound):
        return "the micro-batches call the model with different non-tensor arguments", []
    cached = _graphs.get(model)
    if cached is None or cached[0] != (_fingerprint(model), constants):
        graph = _trace(model, bound[0][1])
        # Keyed by the state after tracing: a forward with side effects is not traced again for the same state.
        cached = (_fingerprint(model), constants), graph
        _graphs[model] = cached
    return cached[1], [values for values, _ in bound]


def give_up_graph(model: nn.Module, reason: str) -> None:
    """Remember that the model's current graph cannot run its forward (until the model changes)."""
    if model in _graphs:
        _graphs[model] = _graphs[model][0], reason


def _bind(model: nn.Module, args: tuple, kwargs: dict) -> tuple[list[Any], dict[str, Any]] | str:
    """The call's arguments in the forward's order, and those that are constants; or why it cannot be traced."""
    # torch.compile's wrapper can only exist once torch._dynamo is imported (importing it would take a second)
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if isinstance(model, torch.jit.ScriptModule) or (eval_frame and isinstance(model, eval_frame.OptimizedModule)):
        return f"{type(model).__name__} is not traced by torch.fx"
    signature = inspect.signature(type(model).forward)
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()):
        return "the model's forward takes *args or **kwargs"
    try:
        call = signature.bind(model, *args, **kwargs)
    except TypeError as e:
        return f"the model's forward does not take these arguments ({e})"
    call.apply_defaults()
    values, concrete = list(call.arguments.values())[1:], {}
    for name, value in list(call.arguments.items())[1:]:
        if isinstance(value, _CONSTANTS):
            concrete[name] = value
        elif not isinstance(value, torch.Tensor):
            return f"the model's argument {name} is a {type(value).__name__}, neither a tensor nor a constant"
    return values, concrete


def _fingerprint(model: nn.Module) -> tuple:
    """What a trace bakes in: each module, its hooks, the names of its attributes and the values of the plain ones
    (train/eval mode, a drop rate, a flag)."""
    return tuple((id(m), tuple(len(getattr(m, h)) for h in _HOOKS), tuple(vars(m)),
                  tuple((k, v) for k, v in vars(m).items() if isinstance(v, _CONSTANTS)))
                 for m in model.modules())


def _trace(model: nn.Module, concrete: dict[str, Any]) -> ForwardGraph | str:
    if any(getattr(module_globals, h) for h in _GLOBAL_HOOKS):
        return "global module hooks are registered, and a graph would skip them"
    tracer = _Tracer()
    reason = _untrusted(model, tracer)  # before tracing: tracing runs the Python of every such module once
    if reason is not None:
        return reason
    before, state = set(vars(model)), _fingerprint(model)
    attributes = [(m, dict(vars(m))) for m in model.modules()]
    try:
        graph = tracer.trace(model, concrete_args=concrete or None)
    except Exception as e:  # noqa: BLE001 - any failure to trace means: run the forward as Python
        return f"torch.fx cannot trace the model ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    finally:
        # fx keeps the tensor constants it meets as attributes of the traced root: move them off the user's model.
        constants = {name: vars(model)[name] for name in set(vars(model)) - before
                     if name.startswith("_tensor_constant")}
        for name in constants:
            delattr(model, name)
    if _fingerprint(model) != state:
        for m, attrs in attributes:  # undo what the one Python run of the trace did to the modules
            vars(m).clear()
            vars(m).update(attrs)
        return "tracing the forward changed a module's attributes: it has Python side effects a graph would skip"
    return ForwardGraph(graph, model, constants)


def _untrusted(model: nn.Module, tracer: _Tracer) -> str | None:
    """Why a module that tracing would go through (not a leaf, nor inside one) cannot be replayed from a graph."""
    leaves: list[str] = []
    for name, m in model.named_modules():
        if any(name.startswith(leaf + ".") for leaf in leaves):
            continue
        if name and tracer.is_leaf_module(m, name):
            leaves.append(name)
            continue
        cls = type(m)
        if cls not in _trace_safe and not cls.__module__.startswith(_TRUSTED_LIBRARIES):
            return (f"{cls.__module__}.{cls.__qualname__} ({name or 'the model'}) is not declared "
                    "accumnorm.trace_safe")
        if name and any(getattr(m, h) for h in _HOOKS):
            return f"the module {name} has hooks, which a graph would skip"
    return None
