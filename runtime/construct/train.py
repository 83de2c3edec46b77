"""Training loops: MLM on the lower layers, PET and head fine-tuning on precomputed upper-layer
inputs, full fine-tuning baselines, and window distillation.

All loops share one optimizer loop (_fit): AdamW with weight decay on every trained tensor,
gradient clipping at 1.0, linear warmup then linear decay to zero, fixed seeds (a private
torch.Generator, never the global RNG), a tqdm bar with rate and ETA, and a step cap of
min(max_steps, epochs * batches per epoch). There is no dropout by default: the reference has
none, so training sees exactly the function serving computes (PET papers tune with dropout,
which matters for long runs on small data more than for these). train_pet takes BERT's and
PEFT's dropout as options (TrainConfig.dropout, lora_dropout), applied in training only.
Loops that train shared weights work on a copy of the encoder and return it; the caller's
encoder is never changed. Each loop also returns its per-step losses.

"Precomputed inputs" are (L, d) tensors per example: what the upper layers see, produced by
the caller from PLOT lookups + aggregate, or from encoder.lower.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
import tqdm

from runtime.construct.data import IGNORE
from runtime.model import pet as petlib
from runtime.model.encoder import Encoder
from runtime.plot.window import windowed_lower


@dataclass(frozen=True)
class TrainConfig:
    lr: float
    epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 16
    warmup: float = 0.1  # fraction of the steps spent warming up
    weight_decay: float = 0.01
    l1: float = 1e-5  # diff PETs: weight of the L1 penalty on the dense delta
    seed: int = 0
    progress: bool = True
    # train_pet only, training only (serving never drops): BERT's hidden/attention dropout and
    # PEFT's lora_dropout. Off by default: see the module doc.
    dropout: float = 0.0
    lora_dropout: float = 0.0


# -- (a) masked-LM further pre-training of the lower layers -----------------------------------


def train_mlm(encoder: Encoder, docs: list[list[int]], cfg: TrainConfig, mask_rate: float = 0.15):
    """MLM on token id lists; returns (encoder copy with trained lower layers, losses).

    Only the lower layers (embeddings included) learn: the upper layers stay frozen so the
    tenants' PETs, trained against them, keep working. The MLM head is BERT's shape - dense +
    GELU + LayerNorm, then the (tied, trainable) word embeddings plus a bias - freshly
    initialized, since sentence-transformer checkpoints ship none; it is discarded afterwards.
    """
    student = copy.deepcopy(encoder)
    g = torch.Generator().manual_seed(cfg.seed)
    mlm_head, head_params = _mlm_head(student, g)
    mask_id = student.tokenizer.token_to_id("[MASK]")
    if mask_id is None:
        raise ValueError("the tokenizer has no [MASK] token")
    never = torch.tensor([student.config.pad_id, *(student.tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]"))])

    def loss_of(batch):
        ids, real = student.pad([docs[j] for j in batch])
        inputs, targets = _mask_tokens(ids, real & ~torch.isin(ids, never), mask_id, student.config.vocab_size, mask_rate, g)
        chosen = targets != IGNORE
        return _cross_entropy(mlm_head(student(inputs, real)[chosen]), targets[chosen])

    lower = [p.requires_grad_(True) for p in student.lower_parameters()]
    log = _fit(lower + head_params, len(docs), loss_of, cfg, "mlm")
    return student.requires_grad_(False), log


def _mlm_head(student, g: torch.Generator):
    c = student.config
    dense_w = (torch.randn(c.d, c.d, generator=g) * 0.02).requires_grad_(True)  # BERT's init range
    dense_b, ln_b, bias = (torch.zeros(n).requires_grad_(True) for n in (c.d, c.d, c.vocab_size))
    ln_w = torch.ones(c.d).requires_grad_(True)

    def mlm_head(h):
        h = F.layer_norm(F.gelu(F.linear(h, dense_w, dense_b)), (c.d,), ln_w, ln_b, c.eps)
        return F.linear(h, student.word.weight, bias)

    return mlm_head, [dense_w, dense_b, ln_w, ln_b, bias]


def _mask_tokens(ids, candidates, mask_id: int, vocab_size: int, rate: float, g):
    """BERT's corruption: pick `rate` of the candidates; of those 80% -> [MASK], 10% -> a random
    id, 10% kept. Returns (inputs, targets), targets IGNORE where nothing was picked."""
    chosen = candidates & (torch.rand(ids.shape, generator=g) < rate)
    r = torch.rand(ids.shape, generator=g)
    inputs = ids.clone()
    inputs[chosen & (r < 0.8)] = mask_id
    swap = chosen & (r >= 0.8) & (r < 0.9)
    inputs[swap] = torch.randint(vocab_size, (int(swap.sum()),), generator=g)
    return inputs, torch.where(chosen, ids, IGNORE)


# -- (b, d) PET / head-only fine-tuning on precomputed inputs ---------------------------------


def train_pet(encoder: Encoder, pet: petlib.Pet, inputs: list[torch.Tensor], labels: list, cfg: TrainConfig):
    """Train pet's tensors (in place) with every shared weight frozen; returns (export(pet), losses).

    labels: one int per example (classification) or an int list per token, IGNORE for
    skipped sub-tokens (tagging). A pet of type "head" is the head-only baseline (d).
    """

    drop = _dropout(cfg)

    def loss_of(batch):
        x, real = _pad_inputs([inputs[j] for j in batch])
        if drop is not None and encoder.lower_layers == 0:  # the inputs are embeddings, which BERT drops
            x = drop("hidden", x)
        logits = petlib.head(pet, encoder.upper(x, real, pet, drop))
        task_loss = _task_loss(pet.meta["task"], logits, [labels[j] for j in batch])
        return task_loss + cfg.l1 * petlib.l1_penalty(pet)

    log = _fit(list(pet.tensors.values()), len(inputs), loss_of, cfg, f"{pet.meta['pet_type']} pet")
    return petlib.export(pet), log


def _dropout(cfg: TrainConfig):
    """drop(place, x) for Encoder.layer with cfg's rates (a seeded generator of its own, so
    the batch order is the same with and without dropout); None when every rate is 0."""
    rates = {"hidden": cfg.dropout, "attention": cfg.dropout, "lora": cfg.lora_dropout}
    if not any(rates.values()):
        return None
    if not all(0 <= r < 1 for r in rates.values()):
        raise ValueError(f"dropout rates must be in [0, 1), got {cfg.dropout} and {cfg.lora_dropout}")
    g = torch.Generator().manual_seed(cfg.seed + 1)

    def drop(place, x):
        if not (r := rates[place]):
            return x
        return x * (torch.rand(x.shape, generator=g) >= r) / (1 - r)

    return drop


def trainable(encoder, pet):
    """A stored (exported) PET back in training form, gradients on: diff index/value lists
    become dense deltas, mask index lists keep-scores (dropped weights below the threshold)."""
    from runtime.model.pet import MASK_INIT, Pet, _shape

    out = {}
    for name, v in pet.tensors.items():
        stem, _, suffix = name.rpartition(".")
        kind = stem.split(".")[2] if stem.startswith("layers.") else None
        if kind not in ("diff", "mask"):
            out[name] = v.detach().clone().float().requires_grad_(True)
        elif suffix == "index":
            d_out, d_in = _shape(encoder.config, stem.rsplit(".", 1)[1])
            index = v.long()
            if kind == "diff":
                dense = torch.zeros(d_out * d_in)
                dense[index] = pet.tensors[stem + ".value"].float()
                out[stem + ".delta"] = dense.view(d_out, d_in).requires_grad_(True)
            else:
                dense = torch.full((d_out * d_in,), MASK_INIT)
                dense[index] = -MASK_INIT
                out[stem + ".score"] = dense.view(d_out, d_in).requires_grad_(True)
    return Pet(out, dict(pet.meta))


# -- (c) full fine-tuning baselines -------------------------------------------------------


def train_full(encoder: Encoder, head: petlib.Pet, docs: list[list[int]], labels: list, cfg: TrainConfig):
    """Fine-tune every layer and the head (a "head" PET, trained in place) on token ids;
    returns (trained encoder copy, exported head, losses)."""
    student = copy.deepcopy(encoder)

    def loss_of(batch):
        ids, real = student.pad([docs[j] for j in batch])
        return _task_loss(head.meta["task"], petlib.head(head, student(ids, real, head)), [labels[j] for j in batch])

    params = [p.requires_grad_(True) for p in student.parameters()] + list(head.tensors.values())
    log = _fit(params, len(docs), loss_of, cfg, "full fine-tuning")
    return student.requires_grad_(False), petlib.export(head), log


def train_upper(encoder: Encoder, head: petlib.Pet, inputs: list[torch.Tensor], labels: list, cfg: TrainConfig):
    """Fine-tune the upper layers and the head on precomputed inputs; returns (trained encoder
    copy, exported head, losses)."""
    student = copy.deepcopy(encoder)

    def loss_of(batch):
        x, real = _pad_inputs([inputs[j] for j in batch])
        logits = petlib.head(head, student.upper(x, real, head))
        return _task_loss(head.meta["task"], logits, [labels[j] for j in batch])

    params = [p.requires_grad_(True) for p in student.upper_parameters()] + list(head.tensors.values())
    log = _fit(params, len(inputs), loss_of, cfg, "upper fine-tuning")
    return student.requires_grad_(False), petlib.export(head), log


# -- (e) window distillation ------------------------------------------------------------------


def distill_windows(encoder: Encoder, docs: list[list[int]], n: int, kind: str, cfg: TrainConfig,
                    student: Encoder | None = None):
    """Train the lower layers so that aggregate(window_values(windows)) + a position table
    matches encoder's full-context lower output (MSE over tokens); returns (a copy of student,
    default encoder, trained; losses). A student that is already window-distilled (a distilled
    parent's layers, for a domain whose MLM moved the target a little) needs far fewer steps.

    The target is fixed at the start: the upper layers were trained on the original
    full-context features, so the windowed features should move toward those, not chase a
    target that shifts with the student. The position table (what serving adds after
    aggregation, runtime.construct.plot.fit_position) trains alongside, starting from the per-position
    mean residual, so the layers are not pushed to encode absolute position, which a window
    cannot see; it is discarded afterwards, since the build refits it on the store's lookups.
    """
    with torch.no_grad():
        targets = [encoder.lower(*encoder.pad([doc]))[0] for doc in docs]
        student = copy.deepcopy(student if student is not None else encoder)
        position = torch.zeros(encoder.config.max_len, encoder.config.d)
        count = torch.zeros(encoder.config.max_len, 1)
        for doc, target, x in zip(docs[:512], targets, windowed_lower(student, docs[:512], n, kind)):
            position[:len(doc)] += target - x
            count[:len(doc)] += 1
        position = (position / count.clamp(min=1)).requires_grad_(True)

    def loss_of(batch):
        predicted = torch.cat([x + position[:len(x)] for x in windowed_lower(student, [docs[j] for j in batch], n, kind)])
        return F.mse_loss(predicted, torch.cat([targets[j] for j in batch]))

    params = [p.requires_grad_(True) for p in student.lower_parameters()] + [position]
    log = _fit(params, len(docs), loss_of, cfg, "window distillation")
    return student.requires_grad_(False), log


# -- shared pieces ------------------------------------------------------------------------


def stalled(losses: list[float], min_steps: int = 50) -> bool:
    """Whether a run of at least min_steps never left its starting loss: its last tenth of steps
    averages above 0.9 of its first tenth. A rate near the edge of stability can leave one seed
    there, and that PET answers one label for everything; shorter runs are not judged."""
    if len(losses) < min_steps:
        return False
    ends = loss_ends(losses)
    return ends["loss_last"] > 0.9 * ends["loss_first"]


def unstalled(train, cfg: TrainConfig):
    """(result, losses, the TrainConfig it ran under, the stalled first run's rate, seed and loss
    ends or None) of train(cfg) -> (result, losses), trained once more at half the rate under the
    next seed when the first run stalled."""
    out, log = train(cfg)
    if not stalled(log):
        return out, log, cfg, None
    stall = {"lr": cfg.lr, "seed": cfg.seed, **loss_ends(log)}
    cfg = dataclasses.replace(cfg, lr=cfg.lr / 2, seed=cfg.seed + 1)
    out, log = train(cfg)
    return out, log, cfg, stall


def loss_ends(log) -> dict:
    """The training loss at the start and at the end: the mean over the first and the last tenth
    of the steps (one batch's loss alone swings with what the batch held)."""
    k = max(1, len(log) // 10)
    return {"loss_first": float(sum(log[:k]) / k), "loss_last": float(sum(log[-k:]) / k)}


def _fit(params: list[torch.Tensor], n_examples: int, loss_of, cfg: TrainConfig, desc: str) -> list[float]:
    """The optimizer loop: loss_of(list of example indices) -> scalar loss. Returns the losses."""
    if n_examples == 0:
        raise ValueError(f"{desc}: no training examples")
    g = torch.Generator().manual_seed(cfg.seed)
    per_epoch = math.ceil(n_examples / cfg.batch_size)
    total = per_epoch * cfg.epochs if cfg.max_steps is None else min(cfg.max_steps, per_epoch * cfg.epochs)
    warm = int(cfg.warmup * total)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / (warm + 1) if s < warm else (total - s) / (total - warm)
    )
    log = []
    with tqdm.tqdm(total=total, desc=desc, unit="step", disable=not cfg.progress) as bar:
        for batch in _batches(n_examples, cfg.batch_size, total, g):
            loss = loss_of(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            schedule.step()
            log.append(loss.item())
            bar.set_postfix(loss=f"{log[-1]:.4f}")
            bar.update()
    return log


def _batches(n_examples: int, batch_size: int, total: int, g: torch.Generator):
    """`total` batches of example indices, reshuffled every epoch."""
    steps = 0
    while True:
        for batch in torch.randperm(n_examples, generator=g).split(batch_size):
            if steps == total:
                return
            steps += 1
            yield batch.tolist()


def _pad_inputs(xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad (L, d) inputs into (B, L, d) with the real-token mask."""
    lengths = torch.tensor([len(x) for x in xs])
    return pad_sequence(xs, batch_first=True), torch.arange(int(lengths.max()))[None, :] < lengths[:, None]


def _task_loss(task: str, logits: torch.Tensor, labels: list) -> torch.Tensor:
    if task == "classification":
        return _cross_entropy(logits, torch.as_tensor(labels))
    targets = pad_sequence([torch.as_tensor(y) for y in labels], batch_first=True, padding_value=IGNORE)
    return _cross_entropy(logits.flatten(0, 1), targets.flatten())


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over the non-IGNORE targets; 0 (not NaN) when a batch has none."""
    total = F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")
    return total / (targets != IGNORE).sum().clamp(min=1)
