"""Render and encode, per process: an input file's records to one Outcome each, in order.

    records --Stages.render--> Prepared (rendered samples, their images planned; pairs and groups fitted at once,
                               builder.answers)
            --Stages.screen--> (decontamination:) a sample overlapping an eval set dropped as `contaminated`,
                               or kept with its Finding (prompt_action/action: report)
            --Stages.encode--> Outcome per record: Tokenized (its images placed) | ItemTruncation | RecordError

`outcomes` runs these over a work item's records in chunks: this thread reads and renders, ENCODE_THREADS
threads tokenize. builder.encode stores each Outcome in order.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from packtool.adapters import NO_PROCESSOR, Parsed
from packtool.builder.answers import encode_answers, item_roles
from packtool.builder.store import SegmentRole
from packtool.chat_templates import (
    PROCESSOR_TEMPLATE_FILE,
    TEMPLATE_DIR,
    TEMPLATE_FILE,
    ChatTemplate,
    template_for,
)
from packtool.config import (
    BuildConfig,
    SourceConfig,
    canonical_json,
    config_folder,
    item_fit_parts,
    keyed_parts,
    missing_image_token,
)
from packtool.decontamination import EvalSet, Finding, Sample, eval_set
from packtool.encode import TextTokenizer, encode_batch, has_special_literal, load_tokenizer
from packtool.errors import RecordError
from packtool.format import CONTAMINATED
from packtool.records import CompletionGroup, Example, PreferencePair, Rendered, Tokenized
from packtool.render import render_example
from packtool.render.accelerators import Accelerators, accelerators_for, render_mode
from packtool.truncate import ItemTruncation, truncate_item
from packtool.vision.placing import (
    IMAGE_TOKENS,
    ImageReader,
    PlannedImage,
    place_images,
    plan_images,
)
from packtool.vision.processors import PROCESSOR_FILES, ImageProcessor, load_processor

ENCODE_BATCH = 512  # records rendered, then tokenized together (tokenizers batches in Rust)
# Threads that tokenize and label rendered chunks in one process, while its reading thread renders the
# next (see _outcomes). Two: each spends most of its time in the tokenizer, which releases the GIL, so
# two keep two cores busy beside the renders; a third tokenizes on a core another already holds (~6%
# more tokenizer CPU in all on 2 cores). -j 1 against three threads that each rendered too (6-8
# alternating pairs): alpaca 0.97x, Qwen3 reasoning 0.95x, glaive 0.92x wall.
ENCODE_THREADS = 2
# An item's first chunk (see _chunks). Traced on the alpaca bench set, -j 1 (three items): no thread was in
# the tokenizer for 12-16% of the encode phase with 512-record first chunks, 8-9% with these.
FIRST_CHUNK = 64
PARALLELISM = "TOKENIZERS_PARALLELISM"


@dataclass(frozen=True)
class Stages:
    """Render and encode, with the tokenizer and template loaded once per process."""

    config: BuildConfig
    tokenizer: TextTokenizer
    template: ChatTemplate | None
    # what the render routes learned of the template, and how many samples each route produced
    accelerators: Accelerators
    evals: EvalSet | None = None  # decontamination: the eval sets, indexed once per process
    # `processor:`: the images' plans, the token their placeholder is, the folder their references are relative to
    processor: ImageProcessor | None = None
    image_token_id: int | None = None
    root: Path = Path()

    @classmethod
    def load(cls, config: BuildConfig) -> Stages:
        tokenizer = load_tokenizer(config.tokenizer)
        evals = eval_set(config.decontamination) if config.decontamination is not None else None
        template = template_for(config, tokenizer.config)
        processor = load_processor(Path(config.processor)) if config.processor else None
        image_token = tokenizer.token_id(IMAGE_TOKENS.get(processor.family)) if processor is not None else None
        return cls(
            config,
            tokenizer,
            template,
            accelerators_for(config.run.render),
            evals,
            processor,
            image_token,
            config_folder(config),
        )

    def fit_item(self, item: PreferencePair | CompletionGroup, source: SourceConfig) -> Outcome:
        """A pair or group: its answers encoded with one shared prompt, cut jointly to fit one pack."""
        finding = None
        if self.evals is not None:
            prompt = [m.content for m in item.prompt]
            answers = [m.content for answer in item.answers for m in answer]
            finding = self.evals.index.check([(prompt, answers)])[0]
            if finding is not None and self.evals.drops(finding):
                return contaminated(item.location, item.id, finding)
        try:
            segments = encode_answers(
                item,
                self.template,
                self.tokenizer,
                source.train,
                special_tokens=source.special_tokens,
                add_bos=self.config.encoding.add_bos,
                add_eos=self.config.encoding.add_eos,
                accelerators=self.accelerators,
            )
        except RecordError as error:
            error.sample_id = item.id
            return Outcome(item.location, item.id, error)
        too_long = "pair_too_long" if isinstance(item, PreferencePair) else "group_too_long"
        fitted = truncate_item(segments, self.config.capacity, self.config.truncation.items, too_long=too_long)
        return Outcome(item.location, item.id, fitted, roles=item_roles(item), finding=finding)

    def render(
        self, chunk: list[Parsed | RecordError], source: SourceConfig, images: ImageReader | None = None
    ) -> Prepared:
        """Render each input in order and plan its images (read by `images`); an input that cannot be rendered,
        or whose image cannot be used, gets its Outcome (the RecordError saying why) at once, a rendered one
        waits for `encode`."""
        prepared = Prepared(source.special_tokens)
        for item in chunk:
            if isinstance(item, RecordError):
                prepared.outcomes.append(Outcome("", item.sample_id, item))  # the error names its own file and row
                continue
            if isinstance(item, PreferencePair | CompletionGroup):
                prepared.outcomes.append(self.fit_item(item, source))
                continue
            try:
                rendered = render_example(
                    item,
                    self.template,
                    self.tokenizer.config,
                    source.train,
                    add_bos=self.config.encoding.add_bos,
                    add_eos=self.config.encoding.add_eos,
                    accelerators=self.accelerators,
                )
                planned = self.plan(item, images) if item.images else ()
            except RecordError as error:
                error.sample_id = item.id
                prepared.outcomes.append(Outcome(item.location, item.id, error))
                continue
            prepared.outcomes.append(None)
            prepared.rendered.append(rendered)
            prepared.literals.append(has_special_literal(rendered, self.tokenizer))
            prepared.planned.append(planned)
        return self.screen(prepared)

    def plan(self, example: Example, images: ImageReader | None) -> tuple[PlannedImage, ...]:
        """The example's images read and planned by the processor (a RecordError for the first that cannot be)."""
        if self.processor is None:  # read_file keeps images only for a build with a processor
            raise RecordError(NO_PROCESSOR, kind="images_not_supported")
        if self.image_token_id is None and self.processor.family in IMAGE_TOKENS:
            raise missing_image_token(self.config, self.processor.family)
        return plan_images(example.images, images or ImageReader(), self.processor, self.image_token_id)

    def screen(self, prepared: Prepared) -> Prepared:
        """The chunk checked against the eval sets, in one batch: a sample whose overlap drops it gets its Outcome
        (reason `contaminated`), one kept with an overlap (action: report) carries its Finding to encode."""
        if self.evals is None or not prepared.rendered:
            return prepared
        findings = self.evals.index.check([rendered_pieces(rendered) for rendered in prepared.rendered])
        screened = Prepared(prepared.special_tokens)
        waiting = zip(prepared.rendered, prepared.literals, prepared.planned, findings, strict=True)
        for outcome in prepared.outcomes:
            if outcome is not None:
                screened.outcomes.append(outcome)
                continue
            rendered, literal, planned, finding = next(waiting)
            if finding is not None and self.evals.drops(finding):
                screened.outcomes.append(contaminated(rendered.example.location, rendered.example.id, finding))
                continue
            screened.outcomes.append(None)
            screened.rendered.append(rendered)
            screened.literals.append(literal)
            screened.planned.append(planned)
            screened.findings.append(finding)
        return screened

    def placed(self, result: Tokenized | RecordError, planned: tuple[PlannedImage, ...]) -> Tokenized | RecordError:
        """An encoded document with its images placed (vision.placing), or the RecordError saying why not."""
        if not isinstance(result, Tokenized):
            return result
        assert self.image_token_id is not None
        try:
            return place_images(result, planned, self.image_token_id, self.root)
        except RecordError as error:
            return error

    def encode(self, prepared: Prepared) -> list[Outcome]:
        """The Outcome of each input of a rendered chunk in order: its Tokenized sample or the RecordError
        saying why not, and whether its content spells a special token."""
        add_bos, add_eos = bool(self.config.encoding.add_bos), bool(self.config.encoding.add_eos)
        batch = [(rendered, prepared.special_tokens) for rendered in prepared.rendered]
        results = encode_batch(batch, self.tokenizer, add_bos=add_bos, add_eos=add_eos, literals=prepared.literals)
        if self.image_token_id is not None:
            results = [self.placed(result, planned) for result, planned in zip(results, prepared.planned, strict=True)]
        findings = prepared.findings or [None] * len(prepared.rendered)
        encoded = (
            Outcome(rendered.example.location, rendered.example.id, result, literal, finding=finding)
            for rendered, literal, result, finding in zip(
                prepared.rendered, prepared.literals, results, findings, strict=True
            )
        )
        return [outcome if outcome is not None else next(encoded) for outcome in prepared.outcomes]


@dataclass
class Prepared:
    """A chunk rendered: an Outcome per input already decided (None: rendered, waits for its encoding), and
    the rendered samples in order with has_special_literal of each (searched once, for every policy)."""

    special_tokens: str  # the source's policy for special-token literals
    outcomes: list[Outcome | None] = field(default_factory=list)
    rendered: list[Rendered] = field(default_factory=list)
    literals: list[bool] = field(default_factory=list)
    planned: list[tuple[PlannedImage, ...]] = field(default_factory=list)  # per rendered sample, its images
    findings: list[Finding | None] = field(default_factory=list)  # per rendered sample, when screened


@dataclass(frozen=True, slots=True)
class Outcome:
    location: str
    example_id: str
    result: Tokenized | ItemTruncation | RecordError | None
    special_literal: bool = False
    roles: tuple[SegmentRole, ...] = ()  # per segment of an ItemTruncation
    finding: Finding | None = None  # its overlap with an eval set: the reason of a `contaminated` drop, or reported


def contaminated(location: str, example_id: str, finding: Finding) -> Outcome:
    """The Outcome of a sample dropped for its overlap with an eval set."""
    return Outcome(location, example_id, RecordError(finding.describe(), kind=CONTAMINATED), finding=finding)


def rendered_pieces(rendered: Rendered) -> Sample:
    """A rendered sample as the eval check reads it: the text of each message content (each span) split into what
    is trained (inside a target range: the target pieces) and what is not (the prompt pieces). Template text is
    in neither: it is no one's words."""
    text, prompts, targets = rendered.text, [], []
    for span in rendered.spans:
        at = span.start
        for start, end, _ in rendered.target_ranges:
            low, high = max(start, at), min(end, span.end)
            if low >= high:
                continue
            if low > at:
                prompts.append(text[at:low])
            targets.append(text[low:high])
            at = high
        if at < span.end:
            prompts.append(text[at : span.end])
    return prompts, targets


# One Stages per distinct (tokenizer, template, settings) in this process: a worker serves many items.
_STAGES: dict[str, Stages] = {}


def stages_for(config: BuildConfig) -> Stages:
    # Every config part a Stages reads is in the key, whole: a later build in this process (a notebook, a Ray
    # worker) with another capacity must not fit its pairs to the first build's. So is every file it read,
    # as it is now: a template or tokenizer edited between two builds in one notebook is loaded again.
    key = canonical_json(
        [
            keyed_parts(config, "content", "encode"),
            item_fit_parts(config),
            [s.format for s in config.sources],
            render_mode(config.run.render),  # the environment's switch too, as it is now
            file_identities(config),
            str(config_folder(config)) if config.processor else None,  # image references' folder
        ]
    )
    if key not in _STAGES:
        _STAGES[key] = Stages.load(config)
    return _STAGES[key]


def file_identities(config: BuildConfig) -> list[list[Any]]:
    """What a Stages reads from disk, each file as (path, device, inode, size, mtime, ctime): a write changes
    ctime even when it keeps the size and puts the mtime back, and a stat costs microseconds where hashing
    a 10 MB tokenizer for every work item would not."""
    paths = [config.tokenizer.path, config.tokenizer.config_path]
    paths += list(config.decontamination.against) if config.decontamination is not None else []
    paths += [config.template] if config.template.endswith(".jinja") else []  # a template file, not a name
    paths += [str(Path(config.processor) / name) for name in PROCESSOR_FILES] if config.processor else []
    folders = [Path(config.tokenizer.path).parent] if config.tokenizer.path else []
    folders += [Path(config.processor)] if config.processor else []  # its templates: processor_templates
    for folder in folders:  # a model folder's own templates (chat_templates.model_templates reads these)
        paths += [str(folder / TEMPLATE_FILE), str(folder / PROCESSOR_TEMPLATE_FILE)]
        paths += sorted(str(p) for p in (folder / TEMPLATE_DIR).glob("*.jinja"))
    identities = []
    for path in paths:
        try:
            st = os.stat(path) if path else None
        except OSError:
            st = None
        identities.append([path, *((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) if st else ())])
    return identities


def outcomes(stages: Stages, source: SourceConfig, records: Iterator[Parsed | RecordError]) -> Iterator[Outcome]:
    """The outcomes of a work item's records in order: this thread reads and renders each chunk, ENCODE_THREADS
    threads tokenize and label the chunks rendered before it.

        this thread:  read+render k | read+render k+1 | store k | read+render k+2 | store k+1 ...
        thread 1:                   | tokenize k (Rust, no GIL), label k (GIL) | tokenize k+2 ...
        thread 2:                                     | tokenize k+1, label k+1 | ...

    The tokenizer releases the GIL, so one core tokenizes while the other renders. Renders no longer
    compete with each other for the GIL: three threads that each rendered, tokenized and labelled their
    own chunk took 1.03-1.09x this wall time (alternating pairs; glaive tool records, whose renders
    are long, gained most). Chunks are yielded in input order, so the partition's bytes do not depend
    on timing.
    """
    chunks = _chunks(records, ENCODE_BATCH)
    images = ImageReader() if stages.processor is not None else None  # each image file read once per work item
    with _tokenizer_threads_off(), ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="packtool-encode") as pool:
        pending: deque[Future[list[Outcome]]] = deque()
        for chunk in chunks:
            pending.append(pool.submit(stages.encode, stages.render(chunk, source, images)))
            # store what is done before rendering on, so the partition and memory keep pace
            while len(pending) > ENCODE_THREADS or (pending and pending[0].done()):
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()


@contextlib.contextmanager
def _tokenizer_threads_off() -> Iterator[None]:
    """One tokenizer thread per call while the encode threads run: they already overlap tokenizing
    with rendering, and tokenizers' own pool on top of them only oversubscribes the cores (chat
    bench, -j 1, median of 5: 5.5 s instead of 6.0 s). Worker processes set this for good; in the
    caller's process (-j 1) it is set for the item only, and never over the caller's own choice."""
    if PARALLELISM in os.environ:
        yield
        return
    os.environ[PARALLELISM] = "false"
    try:
        yield
    finally:
        os.environ.pop(PARALLELISM, None)


def _chunks(records: Iterator[Parsed | RecordError], size: int) -> Iterator[list[Parsed | RecordError]]:
    """Chunks of FIRST_CHUNK records, then twice as many each time up to `size`: the tokenizer starts on
    an item's records after 64 are read and rendered, not 512, while one core would wait."""
    n = min(FIRST_CHUNK, size)
    while chunk := list(islice(records, n)):
        yield chunk
        n = min(2 * n, size)
