"""One training recipe per PET type and level: the product's defaults, shared by `hkstore tenant
create` and the accuracy harness (benchmarks.hmi_accuracy), so what the harness measures is what
a tenant gets.

    options, cfg = settings("adapter")                 # the PLOT-level PET tenant create trains
    options, cfg = settings("lora", "full", seed=1)    # the full-depth PET (every encoder layer)
    pet = create_pet(encoder, "adapter", task, labels, **options)
    train_pet(encoder, pet, inputs, targets, cfg)

Levels: "plot" is the upper-layer PET the PLOT and exact levels serve; "full" the full-depth PET
trained on exact inputs (the base encoder's embeddings through all its layers). The PLOT-level
settings are the ones chosen on dev (10 epochs; the default, LoRA r16 on all six projections at
lr 2e-3 with dropout on inputs backed off as unseen text at 0.4, by experiments.plot_recipe; adapter lr 2e-3: 5e-3 scored as well on one
seed but collapsed on sci-cite under another; dense diff 3e-4, by the harness); the
full-depth one is experiments.full_depth's (LoRA r16, alpha 32, all six targets, lr 1e-3, 6%
warm-up: 67.1 against full fine-tuning's 68.4 on the six-task dev mean), trained with dropout
0.1 and LoRA dropout 0.1 as PEFT trains it (training only: serving computes the same function). The sequence length is
the data's, not the recipe's. This module imports no torch until settings() is called.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

LEVELS = ("plot", "full")
# tenant create --corpus: how many unlabeled texts the full-depth level labels for the PLOT level
# (runtime.construct.pseudo). Each costs a labeled example's training time.
MAX_CORPUS = 1000
ALL_TARGETS = ("q", "k", "v", "o", "ffn_in", "ffn_out")  # runtime.model.pet.TARGETS, without torch


@dataclass(frozen=True)
class Recipe:
    lr: float
    epochs: int = 10
    batch_size: int = 16
    warmup: float = 0.1  # share of the steps spent warming up (runtime.construct.train.TrainConfig)
    dropout: float = 0.0  # training only (TrainConfig): BERT's hidden/attention dropout
    lora_dropout: float = 0.0  # training only: PEFT's dropout on a LoRA's input
    # PLOT level only (the full-depth level trains on exact inputs): train on inputs as the
    # version serves text outside its corpus, each backoff step taken with this probability
    # (runtime.plot.unseen). The adapter's 0.3 was chosen on dev (+4.1 / +5.5 points of hPLM on
    # the 2 + 4 / 3 + 3 splits over exact-only training; 0.5 and 0.7 were worse)
    unseen: float = 0.3
    options: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # create_pet keywords


def _recipe(lr, warmup=0.1, dropout=0.0, lora_dropout=0.0, unseen=0.3, **options) -> Recipe:
    return Recipe(lr=lr, warmup=warmup, dropout=dropout, lora_dropout=lora_dropout, unseen=unseen,
                  options=MappingProxyType(options))


# Dense diff/mask edits move every weight of a layer at once: they need a smaller rate.
PLOT = MappingProxyType({
    "adapter": _recipe(2e-3, bottleneck=64),
    # LoRA r16 on every projection at 2e-3 with PEFT's dropout, chosen on dev (experiments.plot_recipe:
    # 4.6 above the adapter on the six tasks' mean), then unseen 0.4 (1.3 more on dev; 0.5 nearly
    # stalled chemprot): BENCHMARKS, PLOT-level recipes
    "lora": _recipe(2e-3, warmup=0.06, dropout=0.1, lora_dropout=0.1, unseen=0.4, rank=16, scale=2.0,
                    targets=ALL_TARGETS),
    "bitfit": _recipe(3e-3),
    "diff": _recipe(3e-4, density=0.005),
    "mask": _recipe(1e-3, density=0.005),
    "head": _recipe(3e-3),
})
FULL = MappingProxyType({
    # dropout at PEFT's rates: on sciie's dev split 51.1 against 48.4 without (PEFT 51.7;
    # PEFT without dropout 48.9: BENCHMARKS, full-depth recipe against PEFT)
    "lora": _recipe(1e-3, warmup=0.06, dropout=0.1, lora_dropout=0.1, rank=16, scale=2.0, targets=ALL_TARGETS),
    "adapter": _recipe(1e-3, warmup=0.06, bottleneck=64),
})
RECIPES = MappingProxyType({"plot": PLOT, "full": FULL})
PLOT_PET_TYPE = "lora"  # the PLOT-level PET tenant create trains unless told otherwise
FULL_PET_TYPE = "lora"  # the full-depth level's default PET
TRAIN_KEYS = ("lr", "epochs", "batch_size", "warmup", "dropout", "lora_dropout")
OPTION_KEYS = ("rank", "scale", "bottleneck", "density", "norms", "targets", "layers")


def recipe(pet_type: str, level: str = "plot") -> Recipe:
    """The recipe of a PET type at a level; ValueError for an unknown one."""
    if level not in RECIPES:
        raise ValueError(f"unknown level {level!r}; expected one of {', '.join(LEVELS)}")
    table = RECIPES[level]
    if pet_type not in table:
        raise ValueError(f"no {level}-level recipe for PET type {pet_type!r}; expected one of {', '.join(table)}")
    return table[pet_type]


def settings(pet_type: str, level: str = "plot", *, seed: int = 0, progress: bool = True, **overrides):
    """(create_pet keywords, TrainConfig) of the recipe, with overrides (TRAIN_KEYS and
    OPTION_KEYS; None means the recipe's) applied."""
    from runtime.construct.train import TrainConfig

    r = recipe(pet_type, level)
    if unknown := sorted(set(overrides) - set(TRAIN_KEYS) - set(OPTION_KEYS)):
        raise ValueError(f"unknown recipe settings {unknown}")
    given = {k: v for k, v in overrides.items() if v is not None}
    train = {k: given.get(k, getattr(r, k)) for k in TRAIN_KEYS}
    if train["epochs"] < 1:
        raise ValueError(f"epochs must be at least 1, got {train['epochs']}")
    options = dict(r.options) | {k: v for k, v in given.items() if k in OPTION_KEYS}
    return options, TrainConfig(**train, seed=seed, progress=progress)


def describe(pet_type: str, level: str = "plot") -> dict:
    """The recipe as a JSON-able dict (for results files and `tenant info`)."""
    r = recipe(pet_type, level)
    return {"pet_type": pet_type, "level": level, **{k: getattr(r, k) for k in TRAIN_KEYS},
            **({"unseen": r.unseen} if level == "plot" else {}),
            **{k: list(v) if isinstance(v, tuple) else v for k, v in r.options.items()}}
