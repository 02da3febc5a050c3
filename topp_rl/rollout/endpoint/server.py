"""`EndpointServer`: the OpenAI-compatible HTTP server of one rollout step, on 127.0.0.1 (aiohttp).

Trajectory t is served under `/traj/<t>/v1`: `POST .../chat/completions` (messages, tools; rendered by the chat
template), `POST .../completions` (a text prompt, or a list of token ids), `GET .../models`. Each request becomes
one model turn of its trajectory (`topp_rl.rollout.trajectory.Trajectory`): its prompt ids join the running sample
when they extend its ids exactly, else they start a new sample (a prefix break); the engine's turn is appended
with its log-probs and kept sets. Responses carry the ids (`prompt_token_ids`, `completion_token_ids` on the
choice). Budgets: a request past `max_turns` model turns, or one whose prompt leaves no room for a model token
under `max_trajectory_tokens`, or one with no room for a turn of `max_new_tokens` in the model's context, is
refused (400) and ends the trajectory (truncated); a completion that would pass the token budget is cut at it.
Each trajectory's client sends its own token (`CLIENT_HEADER`): a request it sends to another trajectory's URL is
refused (403) and fails the sender (foreign_trajectory). Every state change happens on the server's event loop.
What a request asked that the run does not serve (another temperature, an unknown key) is refused (400) and
recorded per trajectory (`refusals`), as is a `max_tokens` above the run's `max_new_tokens`, served capped
(`capped`); `notice(kind, message)` hears of each (the step prints the first of a run).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from topp_rl.data import SamplingParams
from topp_rl.rollout.endpoint.batcher import Retired, TurnBatcher
from topp_rl.rollout.endpoint.wire import (
    CHAT_KEYS,
    COMPLETION_KEYS,
    Refused,
    asked_tokens,
    chat_prompt_ids,
    chat_response,
    check_request,
    completion_prompt_ids,
    completion_response,
    error_body,
    finish_reason,
)
from topp_rl.rollout.trajectory import END_CONTEXT, END_MAX_TOKENS, END_MAX_TURNS, Trajectory, room_for_turn
from topp_rl.tasks.environment import BAD_REQUEST, FOREIGN_TRAJECTORY

MODEL_NAME = "topp-rl-policy"  # what /models lists; a request may name any model (the run serves one)
CLIENT_HEADER = "X-Topp-RL-Client"  # each trajectory's client sends its own token: who sent a request
CAPPED = "max_tokens_capped"  # the notice of a request served below the max_tokens it asked


class ForeignRequest(Exception):
    """A request sent to another trajectory's URL (HTTP 403)."""


class EndpointServer:
    def __init__(self, trajectories: list[Trajectory], batcher: TurnBatcher, *, tokenizer: Any,
                 params: SamplingParams, vocab_size: int, max_turns: int, max_trajectory_tokens: int,
                 context: int | None = None, client_tokens: list[str] | None = None,
                 notice: Callable[[str, str], None] | None = None) -> None:
        self.trajectories, self.batcher, self.tokenizer = trajectories, batcher, tokenizer
        self.params, self.vocab_size = params, vocab_size
        self.max_turns, self.max_tokens, self.context = max_turns, max_trajectory_tokens, context
        self.senders = {token: i for i, token in enumerate(client_tokens or ())}  # CLIENT_HEADER -> trajectory
        self.notice = notice or (lambda kind, message: None)
        self.refusals: dict[int, list[str]] = {}  # trajectory -> its requests refused (400) for what they asked
        self.capped: dict[int, int] = {}  # trajectory -> its requests served below the max_tokens they asked
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> int:
        app = web.Application()
        app.router.add_post("/traj/{t}/v1/chat/completions", self._guarded(self._chat))
        app.router.add_post("/traj/{t}/v1/completions", self._guarded(self._completion))
        app.router.add_get("/traj/{t}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)  # a free port, this host only
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def base_url(self, trajectory: int) -> str:
        return f"http://127.0.0.1:{self.port}/traj/{trajectory}/v1"

    # ----- handlers -----
    def _guarded(self, handler: Callable[[int, dict], Awaitable[dict]]):
        async def serve(request: web.Request) -> web.Response:
            try:
                t = self._trajectory(request)
                self._check_sender(request, t)
                try:
                    body = await request.json()
                except json.JSONDecodeError as e:
                    raise Refused(f"the request body is not JSON: {e}") from e
                return web.json_response(await handler(t, body))
            except Refused as e:
                if self.trajectories[t].live:  # refused for what it asked, not a budget (which ended the trajectory)
                    self.refusals.setdefault(t, []).append(str(e))
                    self.notice(BAD_REQUEST, str(e))
                return web.json_response(error_body(str(e), e.param), status=400)
            except LookupError as e:
                return web.json_response(error_body(str(e), kind="not_found_error"), status=404)
            except ForeignRequest as e:
                return web.json_response(error_body(str(e), kind="permission_error"), status=403)
            except Retired as e:
                return web.json_response(error_body(str(e), kind="conflict_error"), status=409)
            except RuntimeError as e:  # the engine failed (the step raises it) or aborted the turn
                return web.json_response(error_body(str(e), kind="server_error"), status=503)
        return serve

    def _trajectory(self, request: web.Request) -> int:
        key = request.match_info["t"]
        if not key.isdigit() or int(key) >= len(self.trajectories):
            raise LookupError(f"no trajectory {key!r} in this step (0 to {len(self.trajectories) - 1})")
        return int(key)

    def _check_sender(self, request: web.Request, t: int) -> None:
        """A request sent by trajectory u's client to trajectory t's URL (t != u) fails u (foreign_trajectory) and is
        refused: its turn would be trained in t's trajectory, with t's reward. A client that sends no token (not
        the one the step handed over) is served by its URL alone."""
        sender = self.senders.get(request.headers.get(CLIENT_HEADER, ""))
        if sender is None or sender == t:
            return
        message = (f"trajectory {sender}'s client sent a request to trajectory {t}'s URL; each agent call talks to "
                   "its own trajectory (the client it was handed, or its base URL)")
        if sender in self.batcher.live:
            self.trajectories[sender].fail(FOREIGN_TRAJECTORY, message)
            self.batcher.retire(sender)
        raise ForeignRequest(message)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model",
                                                              "owned_by": "topp-rl"}]})

    async def _chat(self, t: int, body: dict) -> dict:
        limit = self._limit(t, body, allowed=CHAT_KEYS)
        ids = chat_prompt_ids(body, self.tokenizer)
        kept, reason = await self._turn(t, ids, limit)
        text = self.tokenizer.decode(kept, skip_special_tokens=True)
        return chat_response(model=str(body.get("model") or MODEL_NAME), prompt_ids=ids, ids=kept, text=text,
                             reason=reason, max_tokens=limit)

    async def _completion(self, t: int, body: dict) -> dict:
        limit = self._limit(t, body, allowed=COMPLETION_KEYS)
        ids = completion_prompt_ids(body, self.tokenizer, self.vocab_size)
        kept, reason = await self._turn(t, ids, limit)
        text = self.tokenizer.decode(kept, skip_special_tokens=True)
        return completion_response(model=str(body.get("model") or MODEL_NAME), prompt_ids=ids, ids=kept, text=text,
                                   reason=reason, max_tokens=limit)

    def _limit(self, t: int, body: dict, *, allowed: set[str]) -> int:
        """The completion's token limit; a request asking more than the run's `max_new_tokens` is served at it
        (its response says finish_reason "length" when the turn reached it, and `max_tokens`: the limit served)."""
        limit = check_request(body, self.params, allowed=allowed)
        asked = asked_tokens(body)
        if asked is not None and asked > limit:
            self.capped[t] = self.capped.get(t, 0) + 1
            self.notice(CAPPED, f"a request asked max_tokens={asked}, more than this run's rollout.max_new_tokens="
                        f"{limit}: served up to {limit} tokens a turn (finish_reason \"length\" where a turn reaches "
                        "it; counted in rollout/max_tokens_capped); raise rollout.max_new_tokens for longer turns")
        return limit

    # ----- one model turn -----
    async def _turn(self, index: int, ids: list[int], limit: int) -> tuple[list[int], str]:
        """(the kept completion ids, finish reason) of the model's turn on `ids`, recorded in trajectory `index`."""
        t = self.trajectories[index]
        self._check_budgets(t, ids)
        out = await self.batcher.generate(index, ids)
        if index not in self.batcher.live:  # its agent ended meanwhile: nothing more is recorded
            raise Retired(f"trajectory {index} ended while the engine answered")
        t.extend_to(ids)
        turn = t.add_model_turn(out, ids, max_tokens=min(self.max_tokens, t.response_tokens + limit),
                                tokenizer=self.tokenizer)
        if turn is None:
            raise RuntimeError(f"the engine aborted this turn: {out.metadata.get('finish_reason')}")
        return turn.ids, finish_reason(out, len(turn.ids))

    def _check_budgets(self, t: Trajectory, ids: list[int]) -> None:
        if not t.live:
            raise Refused(f"this trajectory has ended ({t.end}); no more turns are served")
        if t.turns >= self.max_turns:
            t.end_on_budget(END_MAX_TURNS)
            raise Refused(f"this trajectory has had its rollout.max_turns={self.max_turns} model turns; no more are "
                          "served (the trajectory ends here, truncated)")
        if not room_for_turn(ids, max_new_tokens=self.params.max_new_tokens, context=self.context):
            t.end_on_budget(END_CONTEXT)
            raise Refused(f"this prompt ({len(ids)} tokens) and a turn of rollout.max_new_tokens="
                          f"{self.params.max_new_tokens} pass the model's context of {self.context} tokens; no more "
                          "turns are served (the trajectory ends here, truncated)")
        joins = bool(t.samples) and ids[: len(t.sample.tokens)] == t.sample.tokens
        new_env = len(ids) - len(t.sample.tokens) if joins else 0
        if t.response_tokens + new_env >= self.max_tokens:
            t.end_on_budget(END_MAX_TOKENS)
            raise Refused(f"this trajectory's response tokens ({t.response_tokens} + {new_env} new context) leave "
                          f"no room under rollout.max_trajectory_tokens={self.max_tokens}; no more turns are served "
                          "(the trajectory ends here, truncated)")
