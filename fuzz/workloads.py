"""Workload models: prompts shaped as a serving engine's traffic is, for the machines that drive requests.

The random prompts of ``sequences.py`` share prefixes of every length over a small alphabet: good at splits
and partial pages, poor at reuse (2-5 % of an engine campaign's matches hit). Production traffic reuses long
prefixes; these are its shapes, each a ``Kind``:

* ``SYSTEM``: the example's shared system prompt, then a fresh user turn;
* ``MULTI_TURN``: a conversation continued: a whole earlier request (its prompt and its answer), then a fresh turn;
* ``AGENT_TREE``: a branch off a conversation: its tokens cut after the system prompt, then a fresh tool call;
* ``FEW_SHOT``: the system prompt and one of a few templates of worked examples, then a fresh question;
* ``DOCUMENT``: one of a few long retrieved documents, then a fresh question;
* ``TENANTS``: the system prompt and a fresh turn under another namespace (a salt, a LoRA): it must never hit
  what another tenant cached (the machine draws the namespace);
* ``VISION``: the system prompt, one of a few images, then a fresh question: image ``k``'s placeholder tokens are
  ``IMAGE_TOKEN + k`` (the image's identity in its tokens, as SGLang keys an image by pad values of its hash); a
  target whose engine takes one placeholder id and the image as a multimodal feature (vLLM's) translates them
  (``image_runs``), so two images at one place must never share a block;
* ``REGENERATE``: an earlier prompt sent again whole (a regenerated answer, a retry, parallel sampling): it hits up
  to the last page or hash unit its first sending cached, most often a hit that ends inside a page.

One ``Workload`` per example holds the shared parts (drawn from its seed) and the conversations (the requests
that finished); its sizes follow the pool, so that prompts fit and still press on it. Token ids lie in
[1000, 30000) (images' placeholders from ``IMAGE_TOKEN``): no page pattern of ``sequences.py`` uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

# token ids the shared parts and fresh turns take (below every target's vocabulary size)
FIRST_TOKEN, TOKEN_SPAN = 1000, 29000
# conversations a workload keeps to continue (the newest)
CONVERSATIONS = 16
# a prompt's tokens at most, and the system prompt's, however large the pool: not pool-sized (a big pool fills with
# many prompts), and held below the longest production prompts (tens of thousands of tokens), whose every token
# the lifecycle laws follow in Python
MOST_PROMPT_TOKENS, MOST_SYSTEM_TOKENS = 4_096, 1_024
# a fresh turn's tokens at most (a user turn, a question, a tool call)
MOST_TURN_TOKENS = 1_024
# image k's placeholder tokens (k < IMAGES, each image flanked by text), and an image's tokens at most (576: a
# LLaVA image; a share of the prompt budget below that)
IMAGE_TOKEN, IMAGES, MOST_IMAGE_TOKENS = 1_000_000, 4, 576


class Kind(StrEnum):
    """A workload's prompt shape (the module docstring says each)."""

    SYSTEM = "system prompt"
    MULTI_TURN = "multi-turn"
    AGENT_TREE = "agent tree"
    FEW_SHOT = "few-shot"
    DOCUMENT = "document"
    TENANTS = "tenants"
    VISION = "vision"
    REGENERATE = "regenerate"


def tokens_of(seed: int, part: int, count: int) -> tuple[int, ...]:
    """``count`` token ids of shared part ``part``: the same for the same seed and part, unlike any other's."""
    state = (seed * 1_000_003 + part * 7_919 + 1) % 2**32
    out = []
    for _ in range(count):
        state = (state * 1_664_525 + 1_013_904_223) % 2**32
        out.append(FIRST_TOKEN + (state >> 8) % TOKEN_SPAN)
    return tuple(out)


@dataclass
class Workload:
    """One example's traffic: its shared parts, drawn once from ``seed``, and its conversations, growing."""

    seed: int
    page_size: int
    # tokens a prompt may take: a share of the pool, so that several requests fit and still press on it
    budget: int
    system: tuple[int, ...] = ()
    templates: tuple[tuple[int, ...], ...] = ()
    documents: tuple[tuple[int, ...], ...] = ()
    images: tuple[tuple[int, ...], ...] = ()
    # whole sequences of finished requests (prompt and answer), the newest last
    conversations: list[tuple[int, ...]] = field(default_factory=list)
    # prompts handed out under the default namespace (a tenant's are not re-sent), the newest last
    sent: list[tuple[int, ...]] = field(default_factory=list)
    # fresh parts handed out so far (each fresh turn differs from every other)
    fresh: int = 0

    @classmethod
    def for_pool(cls, seed: int, page_size: int, pool_tokens: int) -> Workload:
        """The shared parts for a pool of ``pool_tokens``: a prompt takes at most a quarter of it, the system
        prompt an eighth (whole pages and a partial one), the templates and documents up to a quarter; each at
        most the sizes production prompts have (``MOST_PROMPT_TOKENS``, ``MOST_SYSTEM_TOKENS``)."""
        budget = max(2, min(pool_tokens // 4, MOST_PROMPT_TOKENS))
        system = tokens_of(seed, 0, max(1, min(pool_tokens // 8, MOST_SYSTEM_TOKENS) + page_size // 2))
        templates = tuple(system + tokens_of(seed, 1 + i, max(1, budget // 8 * (i + 1))) for i in range(3))
        documents = tuple(tokens_of(seed, 10 + i, max(1, budget * 3 // 4 - i * page_size)) for i in range(3))
        # images of different lengths, after the system prompt's partial page: an image starts inside a page, and
        # most end inside one
        images = tuple(
            (IMAGE_TOKEN + i,) * max(1, min(budget // 4, MOST_IMAGE_TOKENS) + 1 + i * (page_size // 3 + 1))
            for i in range(IMAGES)
        )
        return cls(seed, page_size, budget, system, templates, documents, images)

    def turn(self, pages: int) -> tuple[int, ...]:
        """A fresh user turn (or question, or tool call) of about ``pages`` pages (at most ``MOST_TURN_TOKENS``),
        unlike any other."""
        self.fresh += 1
        tokens = min(pages * self.page_size, MOST_TURN_TOKENS) - self.fresh % self.page_size
        return tokens_of(self.seed, 1000 + self.fresh, max(1, tokens))

    def prompt(self, kind: Kind, pick: int, pages: int) -> tuple[int, ...]:
        """A prompt of ``kind``; ``pick`` chooses the conversation, template, document or prompt re-sent and where a
        branch cuts."""
        if kind == Kind.REGENERATE and self.sent:
            return self.sent[-1 - pick % len(self.sent)]
        prompt = self.shaped(kind, pick, self.turn(pages))
        if kind != Kind.TENANTS:
            self.sent.append(prompt)
            del self.sent[:-CONVERSATIONS]
        return prompt

    def shaped(self, kind: Kind, pick: int, turn: tuple[int, ...]) -> tuple[int, ...]:
        """A fresh prompt of ``kind`` ending in ``turn`` (``prompt`` says how ``pick`` chooses), within the budget."""
        if kind in (Kind.SYSTEM, Kind.TENANTS):
            prompt = self.system + turn
        elif kind == Kind.FEW_SHOT:
            prompt = self.templates[pick % len(self.templates)] + turn
        elif kind == Kind.DOCUMENT:
            prompt = self.documents[pick % len(self.documents)] + turn
        elif kind == Kind.VISION:
            prompt = self.system + self.images[pick % len(self.images)] + turn
        elif kind == Kind.REGENERATE or not self.conversations:
            prompt = self.system + turn  # the first prompt to re-send, or the first turn of a conversation
        else:
            history = self.conversations[-1 - pick % len(self.conversations)]
            if kind == Kind.AGENT_TREE:
                # a branch after the system prompt, anywhere in the history
                cut = len(self.system) + pick * 7 % max(1, len(history) - len(self.system) + 1)
                history = history[:cut]
            prompt = history + turn
        if len(prompt) <= self.budget:
            return prompt
        # a conversation past the budget starts again after the system prompt, its newest tokens kept (as a
        # chat front end trims a context that grew too long)
        keep = max(1, self.budget - len(self.system))
        return self.system + prompt[len(prompt) - keep :]

    def answered(self, sequence: tuple[int, ...]) -> None:
        """A request finished with ``sequence`` (its prompt and its answer): a conversation to continue."""
        self.conversations.append(sequence)
        del self.conversations[:-CONVERSATIONS]


def image_runs(tokens: list[int]) -> list[tuple[int, int, int]]:
    """The images among ``tokens``, as ``(image, offset, length)``: each run of one image's placeholder tokens."""
    runs: list[tuple[int, int, int]] = []
    if not tokens or max(tokens) < IMAGE_TOKEN:
        return runs
    for position, token in enumerate(tokens):
        if token < IMAGE_TOKEN:
            continue
        image = token - IMAGE_TOKEN
        if runs and runs[-1][0] == image and runs[-1][1] + runs[-1][2] == position:
            runs[-1] = (image, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((image, position, 1))
    return runs
