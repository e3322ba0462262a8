# %% [markdown]
# # Post-training: LoRA on conversations, the chat template, an adapter peft reads
#
# A chat model's `save_pretrained` directory and a file of conversations are all this
# takes. The notebook
# 1. writes a handful of conversations as JSON Lines (`{"messages": [...]}`, TRL's format);
# 2. fine-tunes low-rank adapters (LoRA) on them on `data=2, fsdp=2, tensor=2`, the frozen
#    base sharded beside them and the loss taken on the assistant's tokens only;
# 3. answers a question with the tuned model, rendered with the model's own chat template;
# 4. exports the adapter alone in PEFT's format and loads it with `peft` onto the
#    transformers model: the same logits, the same reply.
#
# `BASE` names the checkpoint. Left empty, a tiny random Llama with a ChatML tokenizer is
# made here (a stand-in for a download: its replies are learned from these conversations
# only). On Colab, `huggingface_hub.snapshot_download("Qwen/Qwen2.5-0.5B-Instruct")` gives
# a real one (set `SEQ_LEN` to fit its template's system prompt).

# %% [setup]

# %% [parameters]
BASE = ""  # a chat model's save_pretrained directory; "" makes a tiny random Llama here
STEPS = 150
RANK = 8
SEQ_LEN = 64
BATCH_SIZE = 8
LR = 1e-2

# %%
if IN_COLAB:  # transformers is on Colab already; peft may not be
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "peft"], check=True)

import json
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import peft
import torch
import transformers
from flax import nnx

from shardlib.config import CheckpointConfig
from shardlib.data import chat
from shardlib.data.tokenizer import train_tokenizer
from shardlib.interop import hf
from shardlib.train.generate import generate_cached

WORK = Path("post_training_work")
shutil.rmtree(WORK, ignore_errors=True)
WORK.mkdir()

# %% [markdown]
# ## 1. Conversations
# Sums of two digits, one conversation each. Any `{"messages": [{"role", "content"}, ...]}`
# file works; a bad line is refused with the file, the line and what is wrong.

# %%
def conversation(i: int) -> dict:
    a, b = i % 10, i // 10 % 10
    return {"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                         {"role": "assistant", "content": f"{a + b}."}]}


(WORK / "chat.jsonl").write_text("".join(json.dumps(conversation(i)) + "\n"
                                         for i in range(100)))
print((WORK / "chat.jsonl").read_text().splitlines()[23])

# %% [markdown]
# ## 2. The base model
# A stand-in when `BASE` is empty: a 300-token BPE trained on the conversations' text
# (`shardlib tokenizer train`), a random 2-layer Llama, and the ChatML template with
# `{% generation %}` markers, which tell which tokens are the assistant's.

# %%
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{{ '\\n' }}{% else %}{{ m['content'] + '<|im_end|>\\n' }}"
          "{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

if not BASE:
    BASE = str(WORK / "tiny-llama")
    texts = [m["content"] for i in range(100) for m in conversation(i)["messages"]]
    (WORK / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                               for t in texts + ["user assistant system"]))
    bpe = train_tokenizer([str(WORK / "corpus.jsonl")], 300, str(WORK / "tokenizer.json"))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=384, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.2)).save_pretrained(BASE)
    transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(bpe.path), additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
        chat_template=CHATML).save_pretrained(BASE)

template = chat.load_chat_tokenizer(BASE)
rendered = template.apply_chat_template(conversation(23)["messages"], tokenize=False)
print(rendered)

# %% [markdown]
# ## 3. LoRA fine-tuning on 8 devices
# `lora.rank` adds adapters to every attention and MLP projection (`lora.targets`); the
# base weights are frozen (no gradients, no optimizer state) and live, sharded by the same
# rules, in the state's `model_state`. The conversations are rendered with the template,
# packed into rows of `SEQ_LEN` tokens that attention keeps apart, and the loss is the mean
# over the assistant's tokens (`data.format=auto` sees `messages`).

# %%
config = shardlib.Config(
    mesh=shardlib.MeshConfig(data=2, fsdp=2, tensor=2),
    model=hf.load_config(BASE),
    lora=shardlib.LoRAConfig(rank=RANK, alpha=2.0 * RANK),
    train=shardlib.TrainConfig(init_from=BASE, data=str(WORK / "chat.jsonl"), steps=STEPS,
                               batch_size=BATCH_SIZE, seq_len=SEQ_LEN, log_every=1,
                               eval_every=STEPS, sample_tokens=0),
    optim=shardlib.OptimConfig(lr=LR, warmup_steps=5),
    checkpoint=CheckpointConfig(dir=str(WORK / "run"), every=STEPS))
result = shardlib.train(config, devices=DEVICES)

trained = sum(x.size for x in jax.tree.leaves(result.state.params))
frozen = sum(x.size for x in jax.tree.leaves(result.state.model_state))
print(f"trained {trained:,} adapter parameters beside {frozen:,} frozen ones "
      f"({trained / frozen:.1%}); loss {result.summary['first_loss']:.3f} -> "
      f"{result.summary['final_loss']:.3f}")

steps = [r["step"] for r in result.history if "loss" in r]
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(steps, [r["loss"] for r in result.history if "loss" in r])
ax.set(xlabel="step", ylabel="loss on assistant tokens (nats)",
       title="LoRA on data=2, fsdp=2, tensor=2")
plt.show()

# %% [markdown]
# ## 4. Ask the tuned model, with the chat template
# The prompt is one user message rendered with the template and its generation prompt;
# decoding stops at the template's end-of-turn token. The adapters are part of the model:
# give `generate_cached` the trained adapters and the frozen base together (`weights()`).

# %%
question = [{"role": "user", "content": "What is 3 + 4?"}]
prompt = chat.prompt_ids(template, question)
weights = result.state.weights()  # the adapters and the frozen base
reply_ids = generate_cached(result.setup, weights, [prompt], 8,
                            stop_tokens=chat.stop_ids(template))[0]
ours_reply = template.decode(reply_ids, skip_special_tokens=True)
print("shardlib:", repr(ours_reply))

# %% [markdown]
# ## 5. The adapter alone, in PEFT's format
# `shardlib export --format peft --checkpoint-dir DIR --out ADAPTER` reads the adapters
# from the checkpoint on the host; from Python, `peft_io.save_adapter` writes those of a
# model. `peft.PeftModel.from_pretrained` puts them on the transformers model: its logits
# are shardlib's, and so is its greedy reply.

# %%
from shardlib.cli import main

assert main(["export", "--format", "peft", "--checkpoint-dir", str(WORK / "run"),
             "--out", str(WORK / "adapter")]) == 0
print(json.dumps(json.loads((WORK / "adapter" / "adapter_config.json").read_text()))[:300])

module = nnx.merge(result.setup.graphdef, result.state.params, result.state.model_state)
module.eval()
tokens = np.asarray([prompt])
ours_logits = np.asarray(jax.jit(lambda m, x: m(x))(module, tokens))

base = transformers.AutoModelForCausalLM.from_pretrained(BASE, torch_dtype=torch.float32)
tuned = peft.PeftModel.from_pretrained(base, WORK / "adapter").eval()
with torch.no_grad():
    their_logits = tuned(torch.tensor(tokens)).logits.numpy()
    out = tuned.generate(torch.tensor(tokens), max_new_tokens=8, do_sample=False,
                         eos_token_id=template.convert_tokens_to_ids("<|im_end|>"))
their_reply = template.decode(out[0, len(prompt):], skip_special_tokens=True)
print(f"max |logit difference| shardlib vs peft: {np.abs(ours_logits - their_logits).max():.1e}")
print("peft:    ", repr(their_reply))
assert np.abs(ours_logits - their_logits).max() < 1e-3

# %% [markdown]
# From a terminal, the same run is
# `shardlib train --init-from BASE --data chat.jsonl --mesh data=2,fsdp=2,tensor=2
# --set lora.rank=8 --set lora.alpha=16 --checkpoint-dir runs/lora`, then
# `shardlib export --format peft --checkpoint-dir runs/lora --out runs/adapter`.
# See docs/how-to/sft.md (the template, the mask, packing) and docs/how-to/lora.md
# (QLoRA, dropout, MoE experts, merging); docs/how-to/dpo.md tunes on preferences.
