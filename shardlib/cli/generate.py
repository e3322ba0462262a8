"""``shardlib generate``: continue a prompt with the KV cache, print the text.

The model comes from a Hugging Face directory (``--init-from``, decoded with its
``tokenizer.json`` when there is one; ``--adapter``: a PEFT LoRA adapter on it) or a
training checkpoint (``--checkpoint-dir``, a LoRA run's adapters on its frozen base;
byte-level text as training uses, or ``--tokenizer``'s). Temperature 0 is greedy decoding.
``--chat MESSAGE`` renders a user message with the chat template SFT trained with
(``data.chat``) and prints the assistant's reply, stopped at its end-of-turn token.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
from flax import nnx
from tokenizers import Tokenizer

from shardlib import data as data_lib
from shardlib.checkpoint import Checkpointer
from shardlib.config import Config, LoRAConfig, MeshConfig, ModelConfig, TrainConfig, parse_mesh
from shardlib.data import chat
from shardlib.errors import ShardlibError
from shardlib.export import good_step
from shardlib.interop import peft as peft_io
from shardlib.interop.hf import load_config, load_params, pretrained_state, saved_lora, saved_model
from shardlib.train.generate import generate_cached
from shardlib.train.setup import TrainSetup
from shardlib.train.state import build_setup


class _Text:
    """Text <-> token ids: the HF directory's tokenizer.json, else bytes."""

    stops: tuple[int, ...] = ()

    def __init__(self, directory: str | None):
        path = Path(directory or "") / "tokenizer.json"
        self.tokenizer = Tokenizer.from_file(str(path)) if directory and path.is_file() else None

    def prompt(self, args: argparse.Namespace) -> list[int]:
        return self.encode(args.prompt)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return [int(t) for t in data_lib.encode(text)]
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return data_lib.decode(ids)
        return self.tokenizer.decode(ids)


class _Chat:
    """A user message through the directory's chat template; the reply stops at the
    template's end-of-turn token and is decoded without special tokens."""

    def __init__(self, directory: str | None):
        self.template = chat.load_chat_tokenizer(directory or "")
        self.stops = chat.stop_ids(self.template)

    def prompt(self, args: argparse.Namespace) -> list[int]:
        return chat.prompt_ids(self.template, [{"role": "user", "content": args.chat}])

    def decode(self, ids: list[int]) -> str:
        return self.template.decode(ids, skip_special_tokens=True)


def _model_config(args: argparse.Namespace) -> tuple[ModelConfig, LoRAConfig, int | None]:
    """The model, its adapters' config (rank 0: none) and the checkpoint step (None: HF)."""
    adapter = getattr(args, "adapter", None)
    if args.init_from:
        model = load_config(args.init_from)
        return model, peft_io.read_config(adapter, model) if adapter else LoRAConfig(), None
    if adapter:
        raise ShardlibError(f"--adapter {adapter} with --checkpoint-dir: a checkpoint holds "
                            "its own adapters; give --adapter with --init-from BASE")
    checkpointer = Checkpointer(args.checkpoint_dir, read_only=True)
    step = good_step(checkpointer, None)
    saved = checkpointer.saved_config(step)
    return saved_model(saved), saved_lora(saved), step


def _weights(args: argparse.Namespace, setup: TrainSetup, step: int | None) -> nnx.State:
    """Every variable of the model (with LoRA: the adapters and the frozen base)."""
    if args.checkpoint_dir:
        return Checkpointer(args.checkpoint_dir, read_only=True).restore(setup, step).weights()
    if not setup.config.lora.rank:
        return load_params(args.init_from, setup.config.model, setup.abstract_params,
                           setup.state_shardings.params)
    state = peft_io.adapter_state(setup, pretrained_state(setup, args.init_from), args.adapter)
    return state.weights()


def run_generate(args: argparse.Namespace, devices: list[jax.Device]) -> int:
    """Load, prefill, decode; print the continuation (the prompt is not repeated)."""
    if args.max_new_tokens < 1:
        raise ShardlibError(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    directory = getattr(args, "tokenizer", None) or args.init_from
    text = _Chat(directory) if getattr(args, "chat", None) is not None else _Text(directory)
    prompt = text.prompt(args)
    model, lora, step = _model_config(args)
    if not prompt:
        raise ShardlibError("--prompt: encodes to no tokens; give some text")
    stops = tuple(t for t in text.stops if t < model.vocab_size)
    if model.pos_embedding == "learned" and len(prompt) + args.max_new_tokens > model.max_seq_len:
        raise ShardlibError(f"--max-new-tokens {args.max_new_tokens}: prompt ({len(prompt)}) + "
                            f"new tokens exceed model.max_seq_len={model.max_seq_len}")
    mesh = parse_mesh(args.mesh) if args.mesh is not None else MeshConfig()
    config = Config(mesh=mesh, model=model, lora=lora, train=TrainConfig(
        batch_size=len(devices), seq_len=min(model.max_seq_len, 64), data="synthetic",
        eval_every=0, sample_tokens=0))
    setup = build_setup(config, devices)
    new = generate_cached(setup, _weights(args, setup, step), [prompt], args.max_new_tokens,
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          stop_tokens=stops, seed=args.seed)[0]
    print(text.decode(new), flush=True)
    return 0
