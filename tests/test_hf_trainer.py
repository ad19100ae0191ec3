"""lpoptim inside the Hugging Face Trainer: a tiny LlamaForCausalLM built locally (no downloads) trains on the
bundled tinyshakespeare with lpoptim.AdamW, FP8 saved activations and fp8 linear layers, and its loss falls."""
import pytest
import torch

import lpoptim
from lpoptim.train.data import CharData

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")


class CharBlocks(torch.utils.data.Dataset):
    def __init__(self, data: CharData, block: int, n: int):
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = data.batch("train", n, block, gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def test_trainer_with_lpoptim(tmp_path):
    torch.manual_seed(0)
    data = CharData()
    cfg = transformers.LlamaConfig(vocab_size=80, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    lpoptim.convert_linears(model, recipe="fp8")
    handle = lpoptim.compress_activations(model.model.layers)
    opt = lpoptim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, min_quant_numel=1024)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=40, per_device_train_batch_size=8,
                                          logging_steps=5, report_to=[], use_cpu=True, save_strategy="no",
                                          lr_scheduler_type="constant", disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=CharBlocks(data, 32, 320),
                                   optimizers=(opt, None))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) >= 6
    assert losses[-1] < 0.8 * losses[0], losses  # from about ln(80) = 4.4 towards character statistics
    assert any("exp_avg_scale" in s for s in opt.state.values())  # the FP8 states were used
    assert any(type(m).__name__.endswith("Linear") and m is not model.lm_head and hasattr(m, "recipe")
               for m in model.modules())
    handle.remove()
