"""`RewardModel`: a reward term scored by an HF sequence-classification model with one label (a reward model
checkpoint directory such as a trained `*ForSequenceClassification`).

Config: `task.rewards=[{_target_: topp_rl.tasks.RewardModel, path: DIR}]`, or with a weight and a name
`[{fn: {_target_: topp_rl.tasks.RewardModel, path: DIR}, weight: 0.5, name: rm}]`.

Scored text: `template.format(prompt=record.text, completion=response, answer=record.answer)` (by default the
prompt then the completion), or with `chat_template=true` the tokenizer's chat template over a user turn (the
prompt) and an assistant turn (the completion). Texts are tokenized one by one, padded on the right with the
tokenizer's pad token (its EOS when it has none) and scored `batch_size` at a time under
`torch.inference_mode()`. The score is the model's own pooled logit: HF pools at the last token that is not the
pad token, which right padding makes each text's last real token; a text whose last token is the pad token is
refused, since that pooling would skip it. `max_length` truncates from the left, keeping the completion's end.

Device: the trainer's, handed over by the datamodule at setup (`to_device`), unless `device` names one; never
handed one, it uses the current CUDA device when there is one, else the CPU. The config and tokenizer are checked
when the term is built (at start); the weights load on the first call, on the rank that scores (the rollout
source), so TP / CP peers never hold them.
"""

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from topp_rl.models.builders import _check_tokenizer_files, _load_tokenizer

if TYPE_CHECKING:
    from topp_rl.data import PromptRecord


class RewardModel:
    """Scores `(prompt, completion)` texts with a one-label sequence-classification model (batched, no grads)."""

    def __init__(
        self,
        *,
        path: str | Path,
        batch_size: int = 16,
        max_length: int | None = None,
        template: str = "{prompt}{completion}",
        chat_template: bool = False,
        add_special_tokens: bool = True,
        dtype: str = "float32",
        device: str = "auto",
        name: str = "reward_model",
    ) -> None:
        from transformers import AutoConfig

        self.path = Path(path).expanduser()
        if not (self.path / "config.json").is_file():
            raise ValueError(
                f"reward model path ({self.path}) has no config.json; pass a local HF checkpoint directory of a "
                "sequence-classification model (model.save_pretrained(dir) writes one)"
            )
        _check_tokenizer_files(self.path)
        config = AutoConfig.from_pretrained(self.path, local_files_only=True)
        if config.num_labels != 1:
            raise ValueError(
                f"reward model {self.path} has num_labels={config.num_labels}; a reward model scores with one "
                "label (a *ForSequenceClassification saved with num_labels=1)"
            )
        if batch_size < 1 or (max_length is not None and max_length < 2):
            raise ValueError(
                f"RewardModel(batch_size={batch_size}, max_length={max_length}): need batch_size >= 1 and "
                "max_length >= 2 (or null for no limit)"
            )
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"RewardModel dtype ({dtype!r}) must name a torch dtype, e.g. float32 or bfloat16")
        try:
            template.format(prompt="", completion="", answer="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(
                f"RewardModel template ({template!r}) may use only {{prompt}}, {{completion}} and {{answer}}: {err}"
            ) from err
        self.tokenizer = _load_tokenizer(self.path)
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id
        if self.pad_id is None:
            raise ValueError(
                f"the tokenizer of reward model {self.path} has neither a pad nor an EOS token to pad with"
            )
        if chat_template and not self.tokenizer.chat_template:
            raise ValueError(
                f"RewardModel chat_template=true, but the tokenizer of {self.path} has no chat template; set "
                "chat_template=false (the texts are then `template`)"
            )
        self.batch_size, self.max_length, self.template = batch_size, max_length, template
        self.chat_template, self.add_special_tokens = chat_template, add_special_tokens
        self.dtype, self.device_option, self.name = getattr(torch, dtype), device, name
        self._placed: torch.device | None = None  # the trainer's device, once handed over
        self._model = None

    def to_device(self, device: torch.device) -> None:
        """The trainer's device (ignored when `device` names one)."""
        self._placed = torch.device(device)
        if self._model is not None:
            self._model.to(self.device)

    @property
    def device(self) -> torch.device:
        """Where the model scores: `device` when it names one, else the trainer's, else CUDA's current or CPU."""
        if self.device_option != "auto":
            return torch.device(self.device_option)
        if self._placed is not None:
            return self._placed
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    @property
    def model(self):
        if self._model is None:
            from transformers import AutoModelForSequenceClassification

            model = AutoModelForSequenceClassification.from_pretrained(
                self.path, dtype=self.dtype, local_files_only=True
            )
            # HF pools at the last token that differs from the config's pad id: make it the id we pad with.
            model.config.get_text_config().pad_token_id = self.pad_id
            self._model = model.eval().requires_grad_(False).to(self.device)
        return self._model

    def text(self, response: str, record: "PromptRecord") -> str:
        if self.chat_template:
            messages = [{"role": "user", "content": record.text}, {"role": "assistant", "content": response}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return self.template.format(prompt=record.text, completion=response, answer=record.answer)

    def encode(self, text: str) -> list[int]:
        special = self.add_special_tokens and not self.chat_template  # a chat template writes its own
        ids = list(self.tokenizer(text, add_special_tokens=special)["input_ids"])
        if self.max_length is not None:
            ids = ids[-self.max_length:]
        if not ids or ids[-1] == self.pad_id:
            problem = (
                "has no tokens" if not ids else f"ends in the pad token (id {self.pad_id}), which HF's pooling skips"
            )
            raise ValueError(
                f"reward model {self.path}: the text {text[-80:]!r} {problem}; change the template, or use a "
                "tokenizer with its own pad token"
            )
        return ids

    def __call__(self, responses: list[str], records: list["PromptRecord"]) -> list[float]:
        ids = [self.encode(self.text(r, rec)) for r, rec in zip(responses, records, strict=True)]
        scores: list[float] = []
        for start in range(0, len(ids), self.batch_size):
            scores += self._score(ids[start:start + self.batch_size])
        return scores

    def _score(self, rows: list[list[int]]) -> list[float]:
        width = max(map(len, rows))
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):  # right padding: each text keeps the positions it has alone
            input_ids[i, : len(row)] = torch.tensor(row)
            mask[i, : len(row)] = 1
        model, device = self.model, self.device
        with torch.inference_mode():
            logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits
        return logits[:, 0].float().cpu().tolist()
