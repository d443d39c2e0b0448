"""Guards on how a backward runs: refused before anything steps where the in-backward step would go wrong.

A backward nested in another (a reentrant checkpoint segment, ``autograd.backward`` from a hook) would step on
partial gradients; compiled autograd traces the hooks away; a second backward over a retained graph would step
again on saved tensors that predate the first step. Each is found as the backward begins, from the stack, the
graph or torch's flags.
"""

from __future__ import annotations

import sys

import torch

from dist_optim._torch_internals import (
    BACKWARD_FUNCTION_APPLY,
    COMPILED_AUTOGRAD_SWITCHES,
    ENGINE_RUN_BACKWARD,
    ENGINE_RUN_BACKWARD_RETAIN_GRAPH,
    graph_task_id,
)

__all__: list[str] = []


def backward_frames() -> tuple[bool, list[torch.Tensor] | None, bool]:
    """Read once per backward from this thread's stack: whether the running backward was launched from an autograd
    Function's backward (a reentrant checkpoint: a backward entry point called, indirectly, by
    ``BackwardCFunction.apply``), the tensors it started from (``None`` if not found), and whether it keeps its graph
    (``retain_graph=True``). A backward whose parameters all sit inside reentrant segments would otherwise look like
    one training step per segment."""
    frame = sys._getframe(1)
    roots = None
    retained = False
    while frame is not None:
        code = frame.f_code
        if code.co_name == _RUN_BACKWARD and code.co_filename.endswith(_GRAPH_PY):
            if roots is None:
                outputs = frame.f_locals.get(_ROOTS)
                roots = list(outputs) if isinstance(outputs, (list, tuple)) else []
                args = frame.f_locals.get(_RETAIN_ARGS) or ()
                retained = len(args) > _RETAIN_AT and bool(args[_RETAIN_AT])
        elif roots is not None and code.co_name == _APPLY and code.co_filename.endswith(_FUNCTION_PY):
            return True, roots, retained
        frame = frame.f_back
    return False, roots, retained


_STEPPED = "dist_optim.stepped"  # key in a graph root's node metadata: a backward through it stepped parameters

TWO_PASS_MESSAGE = (
    "clip_mode='two_pass' steps through opt.backward(loss), which runs a measuring backward and then the stepping "
    "one; this backward was started otherwise (loss.backward()), and refused before anything was stepped. Call "
    "opt.backward(loss) in place of loss.backward(), or choose clip_mode='exact'"
)


STEPPED_GRAPH_MESSAGE = (
    "backward() ran again over a graph kept with retain_graph=True, after a backward through it had already "
    "stepped the parameters in place (the optimizer steps inside backward): the graph's saved tensors predate that "
    "step, so nothing was stepped this time. For several losses over one graph, add them and run one backward "
    "((loss1 + loss2).backward(), or opt.backward(loss1 + loss2)); otherwise run a new forward for each backward "
    "that steps. To measure the global norm first and then clip and step, use clip_mode='two_pass' with "
    "opt.backward(loss)"
)


def guard_graph(roots: list[torch.Tensor] | None, retained: bool) -> None:
    """A backward that steps runs through the graph of ``roots``: a later backward over the same graph (kept with
    ``retain_graph=True``) is refused as it starts, by a pre-hook on the root's node, which lives and dies with the
    graph. Its saved tensors predate the step, which changed the parameters in place; torch would fail with a
    version error that does not say why, or step a second time on the same batch. When this backward keeps its
    graph (``retained``), a later backward from another root into the same graph (a second loss of a multi-task
    model) is refused too: every node that computes a parameter's gradient gets a pre-hook that refuses a backward
    other than this one, before the node reads its saved tensors."""
    root = next((t.grad_fn for t in roots or () if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
    if root is None or root.metadata.get(_STEPPED):
        return
    root.metadata[_STEPPED] = True
    root.register_prehook(_refuse_stepped_graph)
    if retained:
        _guard_gradient_nodes(root, graph_task_id())


def _guard_gradient_nodes(root: torch.autograd.graph.Node, task: int) -> None:
    def refuse_later(grad_outputs: object) -> None:
        if graph_task_id() != task:
            raise RuntimeError(STEPPED_GRAPH_MESSAGE)

    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        children = [n for n, _ in node.next_functions if n is not None]
        if any(hasattr(n, "variable") for n in children) and not node.metadata.get(_STEPPED):
            node.metadata[_STEPPED] = True
            node.register_prehook(refuse_later)
        stack.extend(n for n in children if not hasattr(n, "variable"))


def reaches_stepped_graph(roots: list[torch.Tensor] | None) -> bool:
    """Whether a backward from ``roots`` runs into a graph an earlier stepping backward kept (its nodes marked by
    :func:`guard_graph`): looked for as the backward begins, at its first gradient, before anything of it steps
    (a head of its own, outside the kept graph, would otherwise be stepped before the marked node refuses)."""
    stack = [t.grad_fn for t in roots or () if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.metadata.get(_STEPPED):
            return True
        stack.extend(n for n, _ in node.next_functions if n is not None and not hasattr(n, "variable"))
    return False


def _refuse_stepped_graph(grad_outputs: object) -> None:
    raise RuntimeError(STEPPED_GRAPH_MESSAGE)


def compiled_autograd_message() -> str:
    # Compiled autograd traces the hooks into a graph, where some never run and the end-of-backward callback is
    # lost: parameters would silently not be stepped. Checked once per backward (_torch_internals.compiled_autograd_on)
    # and at construction.
    return (
        f"compiled autograd is on ({COMPILED_AUTOGRAD_SWITCHES[0]}, or {COMPILED_AUTOGRAD_SWITCHES[1]}): it traces "
        "the post-accumulate-grad hooks the in-backward step runs on, and "
        "some of them never run, so parameters would silently not be stepped. Turn compiled autograd off for this "
        "model (torch.compile without it still works: per block keeps the memory saving), or use a standard "
        "optimizer"
    )


# the autograd Function of torch.utils.checkpoint(..., use_reentrant=True), whose backward runs a backward inside
REENTRANT_CHECKPOINT = torch.utils.checkpoint.CheckpointFunction
_RUN_BACKWARD, _GRAPH_PY, _ROOTS = ENGINE_RUN_BACKWARD
_RETAIN_ARGS, _RETAIN_AT = ENGINE_RUN_BACKWARD_RETAIN_GRAPH
_APPLY, _FUNCTION_PY = BACKWARD_FUNCTION_APPLY


def refuse_nested_backward() -> None:
    raise RuntimeError(
        "a backward ran inside another backward (reentrant activation checkpointing, or autograd.backward "
        "called from a hook): parameters would be stepped on partial gradients. Use "
        "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)"
    )
