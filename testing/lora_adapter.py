"""Random PEFT LoRA adapters for the tests and benches, built with peft itself so HF +
peft can serve as the reference for the engine's outputs."""
from __future__ import annotations

from pathlib import Path

from testing.hf_reference import hf_causal_lm

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapter_dir(base_dir: str | Path, out: str | Path, seed: int = 0, r: int = 8,
                          lora_alpha: int = 16, target_modules=LLAMA_TARGETS,
                          **lora_config) -> Path:
    """Write a PEFT adapter (adapter_config.json + adapter_model.safetensors) on the HF
    model in `base_dir`, with random A and B (peft's init_lora_weights=False: B is not
    zero, so the adapter changes outputs)."""
    import peft
    import torch

    model = hf_causal_lm(base_dir, torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules),
                             init_lora_weights=False, **lora_config)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        wrapped = peft.get_peft_model(model, config)
    finally:
        torch.random.set_rng_state(state)
    out = Path(out)
    wrapped.save_pretrained(out)
    return out


def hf_peft_greedy(base_dir: str | Path, adapter_dir: str | Path | None,
                   prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF's greedy tokens (fp32, EOS never ends nor is masked) with the adapter applied
    by peft, or the bare base model when `adapter_dir` is None."""
    import torch

    model = hf_causal_lm(base_dir, torch.float32)
    if adapter_dir is not None:
        import peft
        model = peft.PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    model.generation_config.eos_token_id = None
    outs = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
        outs.append(gen[0, len(ids):].tolist())
    return outs
