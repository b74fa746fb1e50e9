"""Regional compilation of the decoder layers, dispatched by fastgen rather than by Dynamo's frame hook.

Each decoder layer runs through a graph that `torch.compile(fullgraph=True)` traced from one layer, and
the layers share it: with `inline_inbuilt_nn_modules` (torch's default) a layer's parameters are graph
inputs, so Inductor compiles one graph per layer kind and shape class (its FX-graph cache then serves the
next start). Dynamo compiles them, as usual, the first time a layer call finds none that fits. After that
each layer's `forward` (a dispatcher) checks a graph's guards itself, with the guard manager Dynamo built
for it (C++), and runs the graph's code. Every guard is still evaluated on every call, so nothing is
assumed that Dynamo would not have checked. What the dispatcher skips is the wrapping of a compiled frame:
the module's compiled call, the eval-frame hook, the cache walk and the context managers around it, ~70 us
a layer call (2-core EPYC, SmolLM2-135M int4 decode layer: 243 against 312 us, ~2 ms of a 30-layer step).
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("fastgen")

_RECOMPILE_LIMIT = 8
"""Graphs a layer may add after warm-up before its steps run eagerly instead (a shape class serving was
never warmed up for compiles once, with a warning; more mean something varies per step)."""


def _layer_step(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What the graphs are traced from: the layer class's own forward (the instance's is the dispatcher).
    Each `CompiledLayers` traces its own copy of this code, so Dynamo keeps its graphs apart from other
    engines' in the process."""
    return type(layer).forward(layer, *args, **kwargs)


class CompiledLayers:
    """The decoder layers' forwards through shared compiled graphs, each picked by its guards.

    `dynamic`: every dimension of the step symbolic, size-oblivious (a 1 is not special) and not
    duck-sized (two sizes that happen to match are not assumed equal), so one graph serves every step
    size; otherwise (CUDA-graph buckets) each bucket is one static specialisation. `mode`: Inductor's
    mode (None: its default).
    """

    def __init__(self, layers: nn.ModuleList, dynamic: bool, mode: str | None) -> None:
        self.dynamic = dynamic
        self._code = _layer_step.__code__.replace()
        self._compiled = torch.compile(types.FunctionType(self._code, _layer_step.__globals__, "_layer_step"),
                                       fullgraph=True, dynamic=dynamic, mode=mode)
        self._graphs: list[Graph] = []
        """Every compiled graph, oldest first; any layer may use any of them."""
        self._serving = False
        self._eager = False
        self._added_since_warmup = 0
        for layer in layers:
            layer.forward = _Dispatch(self, layer)

    @property
    def num_graphs(self) -> int:
        """Graphs compiled so far (one per layer kind and shape class once warmed up)."""
        return len(self._graphs)

    def context(self) -> contextlib.AbstractContextManager:
        """The symbolic-shape settings the graphs are traced under: size-oblivious, no duck sizing."""
        import torch.fx.experimental._config as fx_config

        return fx_config.patch(backed_size_oblivious=self.dynamic, use_duck_shape=not self.dynamic)

    @contextlib.contextmanager
    def eager(self) -> Iterator[None]:
        """Run the layers' own forwards inside this block (a step larger than every bucket)."""
        self._eager, previous = True, self._eager
        try:
            yield
        finally:
            self._eager = previous

    def warmed_up(self) -> None:
        """From now on a graph compiled for a call is a recompile: logged, and limited."""
        self._serving = True

    def compile_call(self, f_locals: dict[str, Any], layer: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, Graph | None]:
        """Run a call no graph of this layer fits: through another layer's graph whose guards pass, else
        through Dynamo, which compiles one (or, past the limit while serving, the layer's own forward).
        Returns (the output, the graph that ran it or None)."""
        for graph in reversed(self._graphs):
            if graph.guards.check(f_locals):
                return graph.run(layer, *args, **kwargs), graph
        if self._serving:
            if self._added_since_warmup >= _RECOMPILE_LIMIT:
                return type(layer).forward(layer, *args, **kwargs), None
            self._added_since_warmup += 1
            logger.warning("fastgen: compiling a decoder-layer graph while serving (a step shape the warm-up did "
                           "not cover); %d more allowed before such steps run eagerly",
                           _RECOMPILE_LIMIT - self._added_since_warmup)
        import torch._dynamo
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        # This engine's graphs are the only ones on its code: the limit only has to hold them all.
        limit = len(self._graphs) + _RECOMPILE_LIMIT + 1
        with self.context(), torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=256):
            out = self._compiled(layer, *args, **kwargs)
        known = {id(graph.code) for graph in self._graphs}
        for entry in reversed(_debug_get_cache_entry_list(self._code)):
            if id(entry.code) not in known:
                self._graphs.append(Graph(entry.guard_manager, entry.code,
                                          types.FunctionType(entry.code, _layer_step.__globals__)))
        return out, next((graph for graph in reversed(self._graphs) if graph.guards.check(f_locals)), None)


@dataclass(frozen=True, slots=True)
class Graph:
    """One compiled specialisation of the layer step: Dynamo's guards for it and its code."""

    guards: Any
    """Dynamo's guard manager: `check(f_locals)` is True where the graph serves a call with those arguments."""
    code: types.CodeType
    """Dynamo's transformed code of `_layer_step` (what its cache entry runs)."""
    run: Callable[..., Any]
    """That code as a function of the layer step's arguments."""


class _Dispatch:
    """A decoder layer's `forward` under `CompiledLayers`: the first of the graphs that served this layer
    (last used first) whose guards pass for the call, else one `CompiledLayers` finds or compiles, else the
    class's own forward (eager steps, and past the recompile limit)."""

    __slots__ = ("owner", "layer", "forward", "candidates")

    def __init__(self, owner: CompiledLayers, layer: nn.Module) -> None:
        self.owner = owner
        self.layer = layer
        self.forward = type(layer).forward.__get__(layer)
        self.candidates: list[Any] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.owner._eager or torch.compiler.is_compiling():
            return self.forward(*args, **kwargs)
        f_locals = {"layer": self.layer, "args": args, "kwargs": kwargs}
        for index, graph in enumerate(self.candidates):
            if graph.guards.check(f_locals):
                if index:
                    self.candidates.insert(0, self.candidates.pop(index))
                return graph.run(self.layer, *args, **kwargs)
        out, graph = self.owner.compile_call(f_locals, self.layer, args, kwargs)
        if graph is not None:
            self.candidates.insert(0, graph)
        return out

