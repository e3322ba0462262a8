"""What a model is to shardlib: a module factory, a loss over a batch, the batch's layout,
and the capabilities the model declares.

Everything that need not know the model (the mesh, the rules, data / FSDP / ZeRO, tensor
parallelism through the rules, precision, accumulation, remat, checkpoints, the loop,
``inspect``) takes a ``Model``. What does need the model (Megatron's explicit regions and
vocab-parallel loss, pipeline stages, context-parallel attention, expert dispatch, text
generation, Hugging Face weights) is a *capability*: a mesh or option that needs one the
model lacks is refused with one ``ConfigError`` naming it.

The built-in GPT family is one ``Model`` among others (``shardlib.models.lm``), registered
here by name (``register``) the way torchtitan registers its ``ModelSpec``s, so that the
trainer reaches it through this contract and imports no model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx
from jax.sharding import Mesh

from shardlib.errors import ConfigError

if TYPE_CHECKING:
    from shardlib.config import Config

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
LossFn = Callable[[nnx.Module, Batch], tuple[jax.Array, Metrics]]
CheckFn = Callable[["Config", Mesh], None]
AfterStepFn = Callable[[nnx.State, Metrics], tuple[nnx.State, Metrics]]
DecodeFn = Callable[..., jax.Array]
StageFn = Callable[..., Any]  # (config, graphdef, policy, *, gathers, keep) -> a stage stack

# name -> what a model that declares it does (the message of a refusal quotes it)
CAPABILITIES: dict[str, str] = {
    "megatron": "explicit Megatron TP/SP: layers call hooks.enter_region / exit_region and "
                "the loss is vocab-parallel (hooks.cross_entropy)",
    "pipeline": "pipeline stages over a stacked layer axis (shardlib.train.pipeline; "
                "the stage stack is the model's pipeline_stage)",
    "context_parallel": "attention through hooks.attention (ring, Ulysses, all-gather)",
    "experts": "mixture-of-experts layers that dispatch through hooks (expert parallelism)",
    "gathers_units": "the model gathers each FSDP unit's weights itself (hooks.gather_weights)",
    "tokens": "a token language model: tokens/s, text data, bits per byte",
    "generate": "text generation (shardlib.train.generate; KV-cache decoding is the "
                "model's decode)",
    "hf": "Hugging Face checkpoints in and out (shardlib.interop.hf)",
    "planner": "the planner's analytic time and memory model (a ModelConfig shape)",
}


@dataclass(frozen=True)
class Model:
    """A model as shardlib trains it.

    ``build(rngs)``: the ``nnx.Module`` (called under ``nnx.eval_shape`` for shapes, and
    inside a sharded ``jit`` to initialise). ``loss(module, batch)``: (a scalar, a dict
    of metrics), each a mean over the batch's rows. ``batch``: each array's name and its
    logical dims (``batch`` for the rows, ``seq`` for a sequence, any other name, or None
    for a dim kept whole), any rank and dtype. ``units``: the attribute paths of the
    model's FSDP units (a list of submodules, or a module of stacked layers), found from
    the model's ``nnx.List``\\ s when None.

    The hooks through which the trainer reaches what is the model's own (None: nothing
    to do): ``check(config, mesh)`` raises on what the model cannot run (its shape, its
    options against the mesh) before any array is allocated; ``after_step(params,
    metrics)`` runs after each optimizer step: the parameters it moves outside the
    gradient and the metrics in their final form; ``decode(module, prompts_bp, lengths_b,
    key, *, length, dtype, **sampling)`` gives new tokens after right-padded prompts
    (the ``generate`` capability's KV-cache decoding); ``pipeline_stage(config,
    graphdef, policy, *, gathers, keep)`` gives the ``pipeline`` capability's stage stack
    (what one stage computes inside the schedule, ``shardlib.train.pipeline``)."""

    build: Callable[[nnx.Rngs], nnx.Module]
    loss: LossFn
    batch: Mapping[str, tuple[str | None, ...]]
    capabilities: frozenset[str] = frozenset()
    name: str = "custom"
    units: tuple[tuple, ...] | None = None
    trainable: type = nnx.Param  # the variables the optimizer updates; the rest is state
    check: CheckFn | None = None
    after_step: AfterStepFn | None = None
    decode: DecodeFn | None = None
    pipeline_stage: StageFn | None = None

    def __post_init__(self) -> None:
        unknown = set(self.capabilities) - set(CAPABILITIES)
        if unknown:
            raise ConfigError(f"Model.capabilities: unknown {sorted(unknown)}; known: "
                              f"{', '.join(CAPABILITIES)}")
        if not self.batch:
            raise ConfigError("Model.batch: empty; name each batch array and its logical dims, "
                              "e.g. {'image': ('batch', None, None, None), 'label': ('batch',)}")
        for key, dims in self.batch.items():
            if not dims or dims[0] != "batch":
                raise ConfigError(f"Model.batch[{key!r}]={dims!r}: the first dim must be "
                                  "'batch' (the rows that data parallelism splits)")

    def has(self, capability: str) -> bool:
        return capability in self.capabilities

    def require(self, capability: str, why: str) -> None:
        """Raise one ``ConfigError`` naming the capability ``why`` (an option) needs."""
        if not self.has(capability):
            raise ConfigError(
                f"{why}: needs the model capability {capability!r} ({CAPABILITIES[capability]}),"
                f" which model {self.name!r} does not declare; drop the option, or use a "
                "model that declares it (the built-in GPT family declares every capability)")

    def run_check(self, config: Config, mesh: Mesh) -> None:
        """The model's own checks of the run (``check``), if it has any."""
        if self.check is not None:
            self.check(config, mesh)

    def finish_step(self, params: nnx.State, metrics: Metrics) -> tuple[nnx.State, Metrics]:
        """``after_step`` if the model has one, else ``params`` and ``metrics`` as they are."""
        return (params, metrics) if self.after_step is None else self.after_step(params, metrics)

    def with_units(self, units: tuple[tuple, ...]) -> Model:
        return replace(self, units=units)


ACTIVATION_NAMES = {"batch": "act_batch", "seq": "act_seq"}


def batch_logical(dims: tuple[str | None, ...]) -> tuple[str | None, ...]:
    """A batch layout's dims in the rules' activation names (``batch`` -> ``act_batch``,
    ``seq`` -> ``act_seq``); other names are looked up in the rules as they are."""
    return tuple(ACTIVATION_NAMES.get(d, d) if d else None for d in dims)


def has_sequence(model: Model) -> bool:
    """Whether a batch array has a ``seq`` dim (the loop then counts tokens)."""
    return any("seq" in dims for dims in model.batch.values())


# --- the pipeline capability: a model whose trained state stacks its layers under "blocks"

def split_blocks(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(the stacked layers' part ``blocks``, everything else) of a model-shaped state."""
    raw = state.raw_mapping
    return state["blocks"], nnx.State({key: value for key, value in raw.items()
                                       if key != "blocks"})


def join_blocks(blocks: nnx.State, rest: nnx.State) -> nnx.State:
    """Inverse of ``split_blocks``."""
    return nnx.State({**rest.raw_mapping, "blocks": blocks.raw_mapping})


def pick(tree: Any, like: Any) -> Any:
    """The entries of ``tree`` at the paths of ``like``: a gradient over the whole weights,
    a LoRA model's frozen base included, cut to the trained ones (XLA then drops the
    frozen weights' gradients, left unused)."""
    found = dict(jax.tree_util.tree_flatten_with_path(tree)[0])
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree.unflatten(treedef, [found[path] for path, _ in paths])


# --- the registry of built-in families ---------------------------------------------------

_FAMILIES: dict[str, Callable[[Config], Model]] = {}


def register(name: str, factory: Callable[[Config], Model]) -> None:
    """Make ``factory(config)`` the model of family ``name`` (``shardlib.models`` registers
    its GPT family as ``gpt`` on import)."""
    _FAMILIES[name] = factory


def builtin(config: Config, family: str = "gpt") -> Model:
    """The built-in family's ``Model`` for ``config.model``."""
    if family not in _FAMILIES:
        raise ConfigError(f"model family {family!r} is not registered (known: "
                          f"{', '.join(_FAMILIES) or 'none'}); import shardlib.models first")
    return _FAMILIES[family](config)


def resolve(config: Config, model: Model | None) -> Model:
    """The user's model, else the built-in GPT for ``config.model``."""
    return builtin(config) if model is None else model
