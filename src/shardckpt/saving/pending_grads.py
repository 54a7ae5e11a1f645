"""Gradients pending at ``save()``: a ``backward()`` after the optimizer's last ``step()``.

A checkpoint holds no ``.grad``: a save in the middle of gradient
accumulation loses the gradients accumulated so far, and a resume from it
is not the uninterrupted run. One global optimizer step post-hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``, registered when
this module is imported) remembers, per optimizer, its first parameter that has
a gradient, that gradient tensor (a weak reference) and its version counter
after the step: O(1) per step. At ``save()``, :func:`pending` compares: another
gradient tensor, or the same one changed in place since (and not all zeros),
means a ``backward()`` ran after the last step. :func:`warn` says so once per
optimizer, at WARNING; ``shardckpt check-resume`` records it with the save.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Mapping

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

log = logging.getLogger("shardckpt")

_after_step: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[Any, Any, int]]" = weakref.WeakKeyDictionary()
_warned: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def _first_grad(optimizer: torch.optim.Optimizer) -> tuple[torch.Tensor, torch.Tensor] | None:
    for group in optimizer.param_groups:
        for param in group.get("params", ()):
            if isinstance(param, torch.Tensor) and param.grad is not None:
                return param, param.grad
    return None


def _stepped(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    found = _first_grad(optimizer)
    if found is None:
        _after_step[optimizer] = (None, None, 0)
    else:
        param, grad = found
        _after_step[optimizer] = (weakref.ref(param), weakref.ref(grad), grad._version)


register_optimizer_step_post_hook(_stepped)


def _is_pending(optimizer: torch.optim.Optimizer) -> bool:
    found = _first_grad(optimizer)
    if found is None:
        return False
    param, grad = found
    seen = _after_step.get(optimizer)
    if seen is not None and seen[0] is not None and seen[0]() is param and seen[1]() is grad \
            and seen[2] == grad._version:
        return False  # the gradient the last step used, untouched since
    local = grad.to_local() if callable(getattr(grad, "to_local", None)) else grad
    return bool(torch.count_nonzero(local).item())  # zero_grad(set_to_none=False) leaves zeros: nothing pending


def pending(state: Mapping[str, Any]) -> list[str]:
    """The keys of ``state``'s optimizers that hold gradients from a ``backward()`` after their last ``step()``."""
    return sorted(k for k, v in state.items() if isinstance(v, torch.optim.Optimizer) and _is_pending(v))


def warn(state: Mapping[str, Any], step: int) -> None:
    """One WARNING per optimizer that has gradients pending at a ``save()``."""
    for key in pending(state):
        optimizer = state[key]
        if optimizer in _warned:
            continue
        _warned.add(optimizer)
        log.warning(
            "shardckpt: step %d: gradients are pending at save() for the optimizer %r (a backward() after its last "
            "step(): the middle of gradient accumulation?). A checkpoint holds no .grad: a resume from this step "
            "loses them and does not continue the run exactly. Remedy: call save() after optimizer.step() (at the "
            "end of an accumulation window)", step, key,
        )
