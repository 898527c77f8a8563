"""``strategy="dash_fsdp"`` on the module layouts users write, in real 2-process gloo runs.

Each model is an unchanged LightningModule whose ``configure_optimizers`` returns AdamW
with a schedule. Inside each rank, after every step, the parameters (gathered from their
shards) are compared with single-process DASH on the same global batches, computed here
without Lightning or FSDP; parameters tied in the unwrapped model must still be one
Parameter object after sharding, and frozen ones must not move.

The zoo: a hand-written GPT laid out on the LightningModule itself (a top-level
``ModuleList``, the output layer tied to the embedding across two direct children, a
parameter registered on the module, a frozen projection, a buffer); Hugging Face
``transformers`` models built from tiny configs (GPT-2, Llama with tied and untied
embeddings, a BERT encoder, BART with embeddings shared by encoder, decoder and head);
LitGPT's ``GPT``; ``torch.nn.Transformer``; a CNN.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers.lightning_parity import PARITY_NUMERICS, clean_process_group, release_process_group  # noqa: F401 (an autouse fixture)
from helpers.spawning import START_METHOD
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_dash import DASH
from lightning_dash.strategies.dash_fsdp import DashFSDPStrategy

VOCAB, WIDTH, LENGTH, GLOBAL_BATCH, STEPS = 13, 16, 6, 4, 3
DASH_OPTIONS = {"block_size": 8, "precondition_frequency": 2, "epsilon": 1e-4, **PARITY_NUMERICS}
Batch = dict[str, torch.Tensor]


# ---------------------------------------------------------------------- the models
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mix(torch.tanh(self.norm(h)))


def tokens_batch(step: int) -> Batch:
    generator = torch.Generator().manual_seed(100 + step)
    return {"tokens": torch.randint(0, VOCAB, (GLOBAL_BATCH, LENGTH + 1), generator=generator)}


def images_batch(step: int) -> Batch:
    generator = torch.Generator().manual_seed(100 + step)
    return {
        "images": torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=generator),
        "labels": torch.randint(0, 5, (GLOBAL_BATCH,), generator=generator),
    }


def in_float64(batch: Batch) -> Batch:
    return {key: value.double() if value.is_floating_point() else value for key, value in batch.items()}


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# losses of the wrapped models (module-level functions: the spawned ranks unpickle them)
def hf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(input_ids=batch["tokens"], labels=batch["tokens"]).loss


def language_model_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return next_token_loss(model(batch["tokens"][:, :-1]), batch["tokens"])


def image_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["images"]), batch["labels"])


class CheckedModule(pl.LightningModule):
    """AdamW + StepLR as a user writes them; each rank checks itself against the reference."""

    batch_fn: Callable[[int], Batch] = staticmethod(tokens_batch)

    def __init__(self) -> None:
        super().__init__()
        self.reference_path: str | None = None
        self.checked_steps: list[int] = []

    def loss(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch, batch_idx):
        full_batch = self.batch_fn(self.trainer.global_step)
        rank, world = self.trainer.global_rank, self.trainer.world_size
        return self.loss(in_float64({key: value[rank::world].contiguous() for key, value in full_batch.items()}))

    def configure_optimizers(self):
        optimizer, scheduler = adamw_with_schedule(self.parameters())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(range(STEPS))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        assert all(isinstance(p, DTensor) for p in self.parameters())
        expected = torch.load(self.reference_path)
        for group in expected["ties"]:  # tied in the unwrapped model: still one Parameter
            named = dict(self.named_parameters(remove_duplicate=False))
            assert all(named[name] is named[group[0]] for name in group), group
        step = self.trainer.global_step
        for name, param in self.named_parameters():
            want = expected["trajectory"][step - 1][name]
            moved = (want - expected["start"][name]).norm()
            got = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            assert (got - want).norm() <= 1e-9 * moved + 1e-12, (name, step, float((got - want).norm()), float(moved))
            if not param.requires_grad:
                assert torch.equal(got, expected["start"][name]), name
        self.checked_steps.append(step)

    def on_train_end(self):
        if self.trainer.global_rank == 0:  # the spawned ranks' proof that every step was checked
            Path(f"{self.reference_path}.checked").write_text(" ".join(map(str, self.checked_steps)))


def adamw_with_schedule(parameters):
    # eps 1e-4 so that roundoff is not amplified: the gradient of an attention key bias is zero but for
    # roundoff, which another summation order changes and Adam with eps 1e-8 turns into a full step
    optimizer = torch.optim.AdamW(parameters, lr=0.02, betas=(0.9, 0.99), eps=1e-4, weight_decay=0.01)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


class FlatGPT(CheckedModule):
    """Everything on the LightningModule itself, as hand-written transformers often are."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(0.1 * torch.randn(LENGTH, WIDTH))
        self.layers = nn.ModuleList([Block(), Block()])
        self.frozen = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("temperature", torch.tensor(1.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h + self.frozen(h))) / self.temperature

    def loss(self, batch: Batch) -> torch.Tensor:
        return next_token_loss(self(batch["tokens"][:, :-1]), batch["tokens"])


class ManualFlatGPT(FlatGPT):
    """The same layout under manual optimization: the backward runs inside ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        scheduler.step()


class SharedLayerLM(CheckedModule):
    """One block used twice, in a ``ModuleDict``, and the head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.parts = nn.ModuleDict({"embed": nn.Embedding(VOCAB, WIDTH), "block": Block()})
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head.weight = self.parts["embed"].weight

    def loss(self, batch: Batch) -> torch.Tensor:
        h = self.parts["embed"](batch["tokens"][:, :-1])
        h = self.parts["block"](self.parts["block"](h))
        return next_token_loss(self.head(h), batch["tokens"])


class Wrapped(CheckedModule):
    """A model built elsewhere as the module's one child, with its own loss."""

    def __init__(self, build: Callable[[], nn.Module], loss: Callable[[nn.Module, Batch], torch.Tensor]) -> None:
        super().__init__()
        self.model = build()
        self.loss_fn = loss

    def loss(self, batch: Batch) -> torch.Tensor:
        return self.loss_fn(self.model, batch)


def hf_causal(config_name: str, **config: object) -> Wrapped:
    import transformers

    settings = dict(vocab_size=VOCAB, **config)
    model_class = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}[config_name]
    config_class = {"gpt2": transformers.GPT2Config, "llama": transformers.LlamaConfig}[config_name]
    return Wrapped(lambda: model_class(config_class(**settings)), hf_loss)


def hf_bert() -> Wrapped:
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=LENGTH + 1,
    )
    return Wrapped(lambda: transformers.BertForMaskedLM(config), hf_loss)


def hf_bart() -> Wrapped:
    import transformers

    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=WIDTH,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=24,
        decoder_ffn_dim=24,
        max_position_embeddings=LENGTH + 1,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        pad_token_id=1,
        decoder_start_token_id=2,
    )
    return Wrapped(lambda: transformers.BartForConditionalGeneration(config), hf_loss)


def litgpt_model() -> Wrapped:
    from litgpt import GPT, Config

    config = Config(block_size=LENGTH, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=WIDTH)
    return Wrapped(lambda: GPT(config), language_model_loss)


class TorchTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.transformer = nn.Transformer(
            WIDTH,
            nhead=2,
            num_encoder_layers=1,
            num_decoder_layers=1,
            dim_feedforward=24,
            dropout=0.0,
            batch_first=True,
        )
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(self.transformer(h, h))


def torch_transformer() -> Wrapped:
    return Wrapped(TorchTransformer, language_model_loss)


class CNN(Wrapped):
    batch_fn = staticmethod(images_batch)


def cnn() -> Wrapped:
    def build() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.GroupNorm(2, 8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 5),
        )

    return CNN(build, image_loss)


LLAMA = dict(hidden_size=WIDTH, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
GPT2 = dict(n_embd=WIDTH, n_layer=2, n_head=2, n_positions=LENGTH + 1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
ZOO: dict[str, Callable[[], CheckedModule]] = {
    "flat_gpt": FlatGPT,
    "flat_gpt_manual": ManualFlatGPT,
    "shared_layer": SharedLayerLM,
    "hf_gpt2": lambda: hf_causal("gpt2", **GPT2),
    "hf_llama_tied": lambda: hf_causal("llama", tie_word_embeddings=True, **LLAMA),
    "hf_llama_untied": lambda: hf_causal("llama", tie_word_embeddings=False, **LLAMA),
    "hf_bert": hf_bert,
    "hf_bart": hf_bart,
    "litgpt": litgpt_model,
    "torch_transformer": torch_transformer,
    "cnn": cnn,
}


# ---------------------------------------------------------------------- the reference
def build(name: str) -> CheckedModule:
    """The model in float64: another summation order then differs by 1e-16, and what DASH and
    Adam amplify of that stays far below the tolerance of the comparison."""
    torch.manual_seed(0)
    return ZOO[name]().double()


def tie_groups(module: nn.Module) -> list[list[str]]:
    """Names that share one Parameter object, for every Parameter with more than one name."""
    by_identity: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_identity.setdefault(id(param), []).append(name)
    return [names for names in by_identity.values() if len(names) > 1]


def reference(name: str, path: Path) -> str:
    """Single-process DASH (converted from the same AdamW + StepLR) on the global batches."""
    module = build(name)
    start = {key: p.detach().clone() for key, p in module.named_parameters()}
    optimizer, scheduler = adamw_with_schedule(module.parameters())
    dash = DASH.from_optimizer(optimizer, **DASH_OPTIONS)
    scheduler.optimizer = dash
    trajectory = []
    for step in range(STEPS):
        dash.zero_grad()
        module.loss(in_float64(module.batch_fn(step))).backward()
        dash.step()
        scheduler.step()
        trajectory.append({key: p.detach().clone() for key, p in module.named_parameters()})
    torch.save({"start": start, "trajectory": trajectory, "ties": tie_groups(module)}, path)
    return str(path)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(ZOO))
def test_unchanged_layout_is_sharded_with_ties_kept_and_matches_single_process_dash(name, tmp_path):
    module = build(name)
    module.reference_path = reference(name, tmp_path / "reference.pt")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DashFSDPStrategy(start_method=START_METHOD, **DASH_OPTIONS),
        max_steps=STEPS,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    assert Path(f"{module.reference_path}.checked").read_text() == " ".join(str(s) for s in range(1, STEPS + 1))
