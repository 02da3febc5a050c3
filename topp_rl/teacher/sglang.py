"""`SGLangTeacher`: a real SGLang server as the distillation teacher (teacher=sglang).

Each sample (prompt + response ids) goes to the server's /generate with `max_new_tokens` 0, `return_logprob` and
`logprob_start_len` = prompt length - 1: the answer's `input_token_logprobs` hold, after the prompt's last token,
the teacher's log-prob of every response token given its prefix (prompt log-probs over the whole sequence).
Departures from the in-process teacher, both refused at start rather than approximated:
- the server returns the log-prob of the given token over the full vocabulary only, not over the student's
  kept set (that would need every kept id's log-prob per position), so `teacher.use_candidate_mask` must be false;
- SGLang's prompt log-probs are at temperature 1 whatever the request's temperature, so `rollout.temperature`
  must be 1 (the in-process teacher is scored at the rollout temperature, like the student).
Every rank asks for its whole micro-batch (CP and TP ranks alike), so no collective is needed.
"""

import torch
from torch import Tensor
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from topp_rl.data import PackedBatch
from topp_rl.engines.serving.client import HTTPClient, Retries, Timeouts
from topp_rl.models import resolve_model_dir
from topp_rl.models.builders import _load_tokenizer
from topp_rl.teacher.hf import check_same_tokenizer, output_rows


class SGLangTeacher:
    """teacher=sglang: `url` of a running SGLang server that serves the teacher; `path`, the checkpoint it serves
    (its tokenizer and vocabulary size are checked against the policy's); `use_candidate_mask` must be false."""

    def __init__(self, *, url: str, path: str, use_candidate_mask: bool = False, max_concurrency: int = 16,
                 timeouts: Timeouts | None = None, retries: Retries | None = None) -> None:
        if use_candidate_mask:
            raise ValueError(
                "teacher=sglang with teacher.use_candidate_mask=true: the server returns each token's log-prob over "
                "the full vocabulary, not over the student's kept set; set teacher.use_candidate_mask=false, or use "
                "teacher=hf_path for a kept-set teacher"
            )
        self.url, self.path, self.use_candidate_mask = url.rstrip("/"), path, False
        self.client = HTTPClient(timeouts=timeouts or Timeouts(), retries=retries or Retries(),
                                 max_concurrency=max_concurrency, label="SGLang teacher")

    def module_parts(self, *, policy: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, policy_name: str) -> dict:
        """`PolicyModule`'s teacher arguments, after checking the served checkpoint's vocabulary against the
        policy's."""
        path = resolve_model_dir(self.path)
        rows = int(AutoConfig.from_pretrained(path, local_files_only=True).vocab_size)
        check_same_tokenizer(policy=(policy_name, output_rows(policy), tokenizer),
                             teacher=(self.path, rows, _load_tokenizer(path)))
        return {"teacher_server": self, "teacher_use_mask": False}

    def logprobs(self, batch: PackedBatch) -> Tensor:
        """The teacher's log-probs [R] of the batch's response tokens, in sample order (float32)."""
        ids = batch.tokens.tolist()
        ends = torch.cumsum(batch.seq_lengths, 0).tolist()
        calls = []
        for end, length, response in zip(ends, batch.seq_lengths.tolist(), batch.response_lengths.tolist(),
                                         strict=True):
            sample = ids[end - length : end]
            calls.append(self.client.submit(self._score, sample, length - response))
        return torch.tensor([lp for call in calls for lp in call.result()], dtype=torch.float32)

    def _score(self, ids: list[int], prompt_len: int) -> list[float]:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                "return_logprob": True, "logprob_start_len": prompt_len - 1}
        out = self.client.post(self.url, "/generate", body, self.client.timeouts.call(tokens=len(ids)))
        entries = out["meta_info"]["input_token_logprobs"][1:]  # the first: the prompt's last token, no log-prob
        if [int(e[1]) for e in entries] != ids[prompt_len:]:
            raise RuntimeError(
                f"SGLang teacher {self.url} returned log-probs of other tokens than the response's "
                f"({[e[1] for e in entries][:8]}... vs {ids[prompt_len:][:8]}...); is it serving {self.path}?"
            )
        return [float(e[0]) for e in entries]

    def close(self) -> None:
        self.client.close()
