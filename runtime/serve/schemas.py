"""Request and response bodies of the HTTP API (pydantic; they make the OpenAPI schema), and their limits."""

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, field_validator, model_validator

from hkstore.store import NAME
from runtime.construct.manager import recipes  # serve reaches construct through the manager

NAME_PATTERN = NAME.pattern  # hkstore.store.check_name's rule, as an OpenAPI pattern


MAX_TEXT_CHARS = 16_384  # per text; the runtime's max_len (tokens) is the real bound


MAX_TEXTS = 1024  # texts per infer request (the dispatcher splits them into batches of max_batch)


MAX_DOCUMENTS = 100_000


MAX_DOCUMENT_CHARS = 100_000


MAX_EXAMPLES = 100_000


MAX_INFER_BODY = 1 << 20  # bytes


MAX_UPLOAD_BODY = 64 << 20  # the manage requests that carry documents or examples (spooled to disk)


MAX_MANAGE_BODY = 64 << 10  # every other request body (a tenant update without examples, a delete)


def _integral(value):
    """3.0 is an integer to JSON Schema (and the OpenAPI description): take it as 3; strings and
    booleans stay refused (the request bodies are strict)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


INTEGRAL = BeforeValidator(_integral)  # last in an Annotated: after Field, or the schema loses its bounds


Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN, min_length=1, max_length=64)]


Text = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS)]


Document = Annotated[str, StringConstraints(min_length=1, max_length=MAX_DOCUMENT_CHARS)]


Label = Annotated[str, StringConstraints(min_length=1, max_length=64)]


Word = Annotated[str, StringConstraints(min_length=1, max_length=100)]


class Strict(BaseModel):
    # strict: no coercion the schema does not show (0 or "yes" for a boolean, "5" or 5.0 for an integer)
    model_config = ConfigDict(extra="forbid", strict=True)


class InferBody(Strict):
    """Exactly one of text and texts."""

    # the schema says what the validator below checks: one of the two, not both
    model_config = ConfigDict(extra="forbid", strict=True,
                              json_schema_extra={"oneOf": [{"required": ["text"]}, {"required": ["texts"]}]})

    # Not nullable (None only when absent): the schema's oneOf counts a key given as null.
    text: Text = None
    texts: Annotated[list[Text], Field(min_length=1, max_length=MAX_TEXTS)] = None
    truncate: Optional[bool] = Field(None, description="Cut texts over the server's max_len tokens instead of "
                                                       "answering 422 (default: the server's --truncate)")
    policy: Optional[Literal["fast", "auto", "exact"]] = Field(
        None, description="fast: the PLOT level only; exact: the tenant's top (its full-depth PET, else full-context "
                          "lower layers); auto: Tabi's dispatcher "
                          "(default once the tenant is profiled, else fast)")
    students: Optional[Annotated[int, Field(ge=0, le=1024), INTEGRAL]] = Field(
        None, description="A tenant with students (hkstore students create): 0 the teacher answers, k the first k "
                          "students (policy fast or auto, not exact; 422 for a tenant without them or more than it has); "
                          "default: the server's pruning policy chooses per batch under the load")
    level: Optional[Literal["plot", "exact", "full"]] = Field(
        None, description="Pins a level instead of a policy: plot (PLOT inputs + the PET), exact (full-context lower "
                          "layers + the PET) or full (the full-depth PET; 422 for a tenant without a current one)")

    @model_validator(mode="after")
    def _one(self):
        if (self.text is None) == (self.texts is None):
            raise ValueError("give exactly one of 'text' and 'texts'")
        for j, t in enumerate(self.all_texts()):
            if not t.strip():
                raise ValueError(f"text {j} is blank")
        return self

    def all_texts(self) -> list:
        return [self.text] if self.text is not None else list(self.texts)


class InferResult(BaseModel):
    task: str
    version: str
    labels: list[str]
    label: Optional[str] = None
    tags: Optional[list[str]] = None
    tokens: Optional[list[str]] = None
    probabilities: list
    batch_size: int
    timings_ms: dict
    truncated: Optional[int] = Field(None, description="Tokens cut off the text's end (truncate)")
    level: Optional[int] = Field(None, description="The level that answered: 1 PLOT (or students), 2 the tenant's top")
    level_name: Optional[str] = Field(None, description="The level that answered by name: students, plot, exact "
                                                        "(full-context lower layers) or full (the tenant's full-depth PET)")
    confidence: Optional[float] = Field(None, description="Calibrated confidence of the answer")
    pruned: Optional[int] = Field(None, description="Words level 2 did not see (word pruning)")
    students: int = Field(0, description="How many students answered (Student Parallelism); 0: the teacher")


class InferResponse(BaseModel):
    tenant: str
    results: list[InferResult]


class DomainCreateBody(Strict):
    name: Name
    parent: Name = "root"
    documents: Annotated[list[Document], Field(min_length=1, max_length=MAX_DOCUMENTS)]
    alpha: Annotated[float, Field(ge=0, le=100)] = 50
    mlm_steps: Annotated[int, Field(ge=0, le=100_000), INTEGRAL] = 100
    lr: Annotated[float, Field(gt=0, le=1)] = 5e-5
    batch_size: Annotated[int, Field(ge=1, le=1024), INTEGRAL] = 16
    max_len: Annotated[int, Field(ge=8, le=512), INTEGRAL] = 128
    seed: Annotated[int, Field(ge=0, le=2**31 - 1), INTEGRAL] = 0


class DomainUpdateBody(Strict):
    new_name: Name
    documents: Annotated[list[Document], Field(min_length=1, max_length=MAX_DOCUMENTS)]
    alpha: Optional[Annotated[float, Field(ge=0, le=100)]] = None
    mlm_steps: Annotated[int, Field(ge=0, le=100_000), INTEGRAL] = 100
    lr: Annotated[float, Field(gt=0, le=1)] = 5e-5
    batch_size: Annotated[int, Field(ge=1, le=1024), INTEGRAL] = 16
    max_len: Optional[Annotated[int, Field(ge=8, le=512), INTEGRAL]] = None
    include_old: bool = True
    seed: Annotated[int, Field(ge=0, le=2**31 - 1), INTEGRAL] = 0


class ClassificationExample(Strict):
    text: Text
    label: Label


def _one_word(values, what):
    for v in values:
        if len(v.split()) != 1 or len(v.splitlines()) != 1:
            raise ValueError(f"{what} must not hold whitespace or line breaks: {v!r}")
    return values


class TaggingExample(Strict):
    tokens: Annotated[list[Word], Field(min_length=1, max_length=512)]
    tags: Annotated[list[Word], Field(min_length=1, max_length=512)]

    @field_validator("tokens", "tags")
    @classmethod
    def _words(cls, v, info):
        return _one_word(v, info.field_name)

    @model_validator(mode="after")
    def _aligned(self):
        if len(self.tokens) != len(self.tags):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.tags)} tags")
        return self


Examples = Annotated[list[Union[ClassificationExample, TaggingExample]], Field(min_length=1, max_length=MAX_EXAMPLES)]


def _check_examples(task, examples):
    want = ClassificationExample if task == "classification" else TaggingExample
    for j, e in enumerate(examples or ()):
        if not isinstance(e, want):
            raise ValueError(f"examples[{j}]: a {task} example is "
                             + ("{text, label}" if task == "classification" else "{tokens, tags}"))


class TenantCreateBody(Strict):
    tenant: Name
    version: Name = "root"
    task: Literal["classification", "tagging"] = "classification"
    examples: Examples
    pet_type: Literal["adapter", "lora", "bitfit", "diff", "mask", "head"] = recipes.PLOT_PET_TYPE  # as `tenant create`
    # the levels to build: the PLOT PET (PLOT and exact levels) and the full-depth PET (the top)
    levels: Annotated[list[Literal["plot", "full"]], Field(min_length=1, max_length=2,
                                                           json_schema_extra={"contains": {"const": "plot"}})] \
        = ["plot", "full"]
    # None: the training recipe's (runtime.construct.recipe)
    epochs: Optional[Annotated[int, Field(ge=1, le=1000), INTEGRAL]] = None
    max_examples: Optional[Annotated[int, Field(ge=1, le=MAX_EXAMPLES), INTEGRAL]] = None
    lr: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    batch_size: Optional[Annotated[int, Field(ge=1, le=1024), INTEGRAL]] = None
    max_len: Annotated[int, Field(ge=8, le=512), INTEGRAL] = 128
    bottleneck: Optional[Annotated[int, Field(ge=1, le=1024), INTEGRAL]] = None
    rank: Optional[Annotated[int, Field(ge=1, le=256), INTEGRAL]] = None
    seed: Annotated[int, Field(ge=0, le=2**31 - 1), INTEGRAL] = 0
    # what each level serves at, as `tenant create --precision` (auto: measured)
    precision: Literal["auto", "fp32", "bf16"] = "auto"

    @field_validator("levels")
    @classmethod
    def _levels(cls, levels):
        if "plot" not in levels:
            raise ValueError("levels must include plot (a full-depth PET is trained beside a tenant's PET)")
        return list(dict.fromkeys(levels))

    @model_validator(mode="after")
    def _task(self):
        _check_examples(self.task, self.examples)
        return self


class TenantUpdateBody(Strict):
    examples: Optional[Examples] = None
    version: Optional[Name] = None
    epochs: Annotated[int, Field(ge=1, le=1000), INTEGRAL] = 1
    max_examples: Optional[Annotated[int, Field(ge=1, le=MAX_EXAMPLES), INTEGRAL]] = None
    lr: Optional[Annotated[float, Field(gt=0, le=1)]] = None
    batch_size: Annotated[int, Field(ge=1, le=1024), INTEGRAL] = 16
    max_len: Optional[Annotated[int, Field(ge=8, le=512), INTEGRAL]] = None
    seed: Annotated[int, Field(ge=0, le=2**31 - 1), INTEGRAL] = 0
    precision: Optional[Literal["auto", "fp32", "bf16"]] = None  # None: as the tenant's was asked

    @model_validator(mode="after")
    def _kinds(self):
        if self.examples:
            kinds = {type(e) for e in self.examples}
            if len(kinds) > 1:
                raise ValueError("examples mix {text, label} and {tokens, tags}")
        return self


class JobView(BaseModel):
    id: str
    kind: str
    state: Literal["queued", "running", "done", "failed"]
    created: float
    started: Optional[float] = None
    finished: Optional[float] = None
    attempts: int
    params: dict
    progress: dict
    result: Optional[dict] = None
    error: Optional[str] = None


class JobAccepted(BaseModel):
    job: JobView


class TenantJobAccepted(BaseModel):
    job: JobView
    token: str = Field(description="the tenant's API token; shown only here, valid once the job is done")


class JobList(BaseModel):
    jobs: list[JobView]


TokenId = Annotated[int, Field(ge=0, lt=1 << 31), INTEGRAL]  # true and "1" are no token ids


TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=8192)]


class EmbeddingsBody(Strict):
    """OpenAI's embeddings request. ``model``: a tenant (its PLOT version and PET) or the base
    model (``base``, or its name as /info and /v1/models show it). ``input``: a text, a list of
    texts, a list of token ids (one input) or a list of lists of token ids, as OpenAI and TEI
    take them; ids are the model's own vocabulary, special tokens included ([CLS] ... [SEP], as
    its tokenizer gives them)."""

    input: Union[Text, Annotated[list[Text], Field(min_length=1, max_length=MAX_TEXTS)], TokenIds,
                 Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_TEXTS)]]
    model: Annotated[str, StringConstraints(min_length=1, max_length=64)] = "base"
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: lists of numbers; base64: each vector's little-endian float32 bytes, "
                             "base64-encoded (what the openai client asks for by default)")
    dimensions: Optional[Annotated[int, Field(ge=1, le=65536), INTEGRAL]] = Field(
        None, description="Keep the first `dimensions` components and L2-normalize them again (as OpenAI's "
                          "text-embedding-3 models and TEI do); at most the model's dimension")
    policy: Optional[Literal["fast", "exact"]] = Field(
        None, description="exact: the whole encoder (the base model's own embedding, as sentence-transformers "
                          "computes it; a tenant's from its version's full-context lower layers); fast: the lower "
                          "layers from the PLOT (HMI's approximation). Default: exact for the base model, fast "
                          "for a tenant")
    truncate: Optional[bool] = Field(None, description="Cut inputs over the token limit instead of answering 422 "
                                                       "(default: the server's --truncate)")
    user: Optional[Annotated[str, StringConstraints(max_length=256)]] = None

    @model_validator(mode="after")
    def _not_blank(self):
        for j, t in enumerate(self.all_inputs()):
            if isinstance(t, str) and not t.strip():
                raise ValueError(f"input {j} is blank")
        return self

    def all_inputs(self) -> list:
        """One entry per input: a text, or a list of token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [list(self.input)]
        return list(self.input)


class Health(BaseModel):
    """Without the admin token only ``status``: the rest tells how the store is used and why it
    is damaged (a file name), which a public probe need not know."""

    status: str = Field(description="ok, or degraded: the store is damaged (the admin token sees the reason; "
                                    "run hkstore verify)")
    reason: Optional[str] = None
    device: Optional[str] = None
    mode: Optional[str] = None
    tenants: Optional[int] = None
    versions: Optional[int] = None
    queue_depth: Optional[int] = None
    jobs: Optional[dict] = None
    jobs_enabled: Optional[bool] = Field(None, description="manage jobs run: here, or (Ray) in the Manager replica")
    workers: Optional[dict] = Field(None, description="hkstore serve --workers N: the worker processes (workers, "
                                                       "alive, restarts, depth, pids)")
