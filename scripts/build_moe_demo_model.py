"""Build the mixture-of-experts demo model (models/moe_demo): a tiny Qwen3-MoE on the demo's task.

The dense demo's twin for issue 28 (MoE): same task data (data/demo/sft.jsonl, train.jsonl, val.jsonl, written
by scripts/build_demo_model.py and only read here), same tokenizer (loaded from models/demo), same noisy
teacher's SFT data (a carry or borrow dropped 60% of the time) and the same SFT loop, so the model starts at
partial accuracy with room for GRPO. The model is a Qwen3MoeForCausalLM with 8 experts, top-2 routing and
renormalised top-k weights, sized so that its compute per token is close to the dense demo's (hidden 128,
4 layers, 2 heads of dim 64, one of vLLM's CPU attention sizes).

Routers start random (a zero router ties every expert: each token would see the same 2 experts' mean), and
SFT adds transformers' load-balancing loss (`router_aux_loss_coef` times Switch Transformer's
`num_experts * sum_e f_e * P_e`, 2.0 when balanced at top-2) so the experts share the work; the model card
reports the expert load that results.

Seeded; `python scripts/build_moe_demo_model.py` rebuilds the committed files (1000 SFT steps of about 0.4 s
each on 2 idle CPU cores; the committed build took 14 minutes on busy ones). `--quick` makes a seconds-long
smoke build for tests.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3MoeConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_demo_model as base  # noqa: E402

NUM_EXPERTS, TOP_K, MOE_INTERMEDIATE = 8, 2, 128
AUX_LOSS_COEF = 0.02


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def build_model(tokenizer) -> torch.nn.Module:
    """A random Qwen3-MoE whose routers start random too (normal, std of the initializer range)."""
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,  # unused: every layer is sparse (mlp_only_layers empty, decoder_sparse_step 1)
        moe_intermediate_size=MOE_INTERMEDIATE,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        router_aux_loss_coef=AUX_LOSS_COEF,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")  # as fast as sdpa at this size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, config.initializer_range)
    return model


def count_parameters(model) -> tuple[int, int]:
    """(total, active per token): a token runs TOP_K of each layer's NUM_EXPERTS experts."""
    total = sum(p.numel() for p in model.parameters())
    experts = sum(
        layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel() for layer in model.model.layers
    )
    return total, total - experts + experts * TOP_K // NUM_EXPERTS


@torch.no_grad()
def expert_load(model, examples: list[tuple[list[int], list[int]]], pad_id: int) -> list[list[float]]:
    """Per layer, the share of routed (token, slot) pairs each expert takes over the real tokens of `examples`."""
    counts = torch.zeros(len(model.model.layers), NUM_EXPERTS)
    for start in range(0, len(examples), 64):
        batch = base.collate(examples[start : start + 64], pad_id)
        outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
        real = batch["attention_mask"].reshape(-1).bool()
        for layer, logits in enumerate(outputs.router_logits):
            chosen = logits[real].topk(TOP_K, dim=-1).indices
            counts[layer] += torch.bincount(chosen.reshape(-1), minlength=NUM_EXPERTS).float()
    return (counts / counts.sum(dim=1, keepdim=True)).tolist()


def write_model_card(out: Path, stats: dict) -> None:
    load_rows = "\n".join(
        f"| {layer} | " + " | ".join(f"{share:.3f}" for share in shares) + " |"
        for layer, shares in enumerate(stats["expert_load"])
    )
    (out / "README.md").write_text(f"""# reinforge mixture-of-experts demo model

A Qwen3-MoE (`Qwen3MoeForCausalLM`, no custom code) of {stats["num_params"] / 1e6:.2f}M parameters, \
{stats["num_active"] / 1e6:.2f}M active per token:
hidden 128, 4 layers, 2 heads of dim 64, {NUM_EXPERTS} experts per layer (SwiGLU, intermediate {MOE_INTERMEDIATE}),
top-{TOP_K} routing with the top-k weights renormalised (`norm_topk_prob`), tied embeddings, float32. It uses
the dense demo's {stats["vocab_size"]}-token tokenizer and task (models/demo, data/demo) and was built from
scratch by `scripts/build_moe_demo_model.py`, so that reinforge's MoE paths run on a laptop CPU.

**How it was built.** Routers started random (normal, std 0.02), then supervised fine-tuning from random
weights for {stats["sft_steps"]} steps (batch 64, peak lr 2e-3, the dense demo's schedule) on
`data/demo/sft.jsonl`, the noisy teacher that drops a needed carry or borrow {base.DROP_PROB:.0%} of the time,
with a load-balancing loss ({AUX_LOSS_COEF:g} x transformers' `load_balancing_loss_func`) added.

**Accuracy on data/demo/val.jsonl** (true answers): greedy {stats["greedy_accuracy"]:.3f} \
on {stats["num_greedy"]} prompts;
temperature 1 {stats["sampled_accuracy"]:.3f} on {stats["num_sample_prompts"]} prompts x 4 samples.

**Expert load** (share of the routed token-slots each expert takes, on the real tokens of the first
{stats["num_load_examples"]} SFT chats; {1 / NUM_EXPERTS:.3f} each is even):

| layer | {" | ".join(str(e) for e in range(NUM_EXPERTS))} |
|---|{"---|" * NUM_EXPERTS}
{load_rows}

Build time: {stats["build_seconds"] / 60:.1f} min on {torch.get_num_threads()} CPU threads.

**Rebuild:** `python scripts/build_moe_demo_model.py` (seeded; reads models/demo's tokenizer and data/demo,
writes models/moe_demo). Chat format, eos and pad tokens: as models/demo.
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=Path("models/demo"))
    parser.add_argument("--data", type=Path, default=Path("data/demo"))
    parser.add_argument("--out", type=Path, default=Path("models/moe_demo"))
    parser.add_argument("--sft-steps", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="a few examples and 5 steps: a smoke build for tests")
    args = parser.parse_args()
    start = time.time()
    torch.manual_seed(base.SEED)
    torch.set_num_threads(2)  # the same thread count everywhere keeps the float arithmetic reproducible
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    sft_chats, val = read_jsonl(args.data / "sft.jsonl"), read_jsonl(args.data / "val.jsonl")
    if args.quick:
        sft_chats, val = sft_chats[:128], val[:4]
    num_steps = 5 if args.quick else args.sft_steps

    model = build_model(tokenizer)
    examples = [base.tokenize_chat(tokenizer, chat) for chat in sft_chats]
    num_params, num_active = count_parameters(model)
    print(f"{len(sft_chats)} sft chats, {len(val)} val prompts; {num_params:,} parameters, {num_active:,} active")
    model.config.output_router_logits = True  # the SFT loss then includes router_aux_loss_coef x the balance loss
    base.sft(model, examples, tokenizer.pad_token_id, num_steps, batch_size=64, peak_lr=2e-3)
    model.config.output_router_logits = False

    stats = {
        "num_params": num_params,
        "num_active": num_active,
        "vocab_size": len(tokenizer),
        "sft_steps": num_steps,
        "num_greedy": len(val),
        "num_sample_prompts": len(val[:100]),
        "num_load_examples": min(len(examples), 512),
        "expert_load": expert_load(model, examples[:512], tokenizer.pad_token_id),
    }
    stats["greedy_accuracy"] = base.accuracy(model, tokenizer, val, num_samples=1, temperature=None)
    stats["sampled_accuracy"] = base.accuracy(model, tokenizer, val[:100], num_samples=4, temperature=1.0)
    print(
        f"val greedy accuracy {stats['greedy_accuracy']:.3f}; "
        f"temperature-1 sampled accuracy {stats['sampled_accuracy']:.3f}"
    )
    for layer, shares in enumerate(stats["expert_load"]):
        print(f"layer {layer} expert load " + " ".join(f"{share:.3f}" for share in shares))

    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out, save_jinja_files=False)  # keep chat_template in tokenizer_config.json
    stats["build_seconds"] = time.time() - start
    write_model_card(args.out, stats)
    print(f"wrote {args.out} in {stats['build_seconds']:.0f}s")


if __name__ == "__main__":
    main()
