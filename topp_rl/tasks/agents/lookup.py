"""`lookup_agent`: the lookup task (`topp_rl.tasks.lookup`) written as agent code against the OpenAI API, two chat
turns: the model names a key ("?c" -> "c"), the agent looks it up in the record's table and tells it "=7", the
model repeats the value. Run it with the shipped data (`data/agent_lookup.jsonl`, conf/task/agent.yaml):

    python train.py task=agent task.agent=topp_rl.tasks.agents.lookup:lookup_agent
"""

from __future__ import annotations

from typing import Any

from topp_rl.tasks.lookup import lookup_score


async def lookup_agent(client: Any, record: Any) -> dict[str, float]:
    """`client`: an `openai.AsyncOpenAI`; `record`: the row's `PromptRecord` (`data`: key, table). Always two turns:
    a call that names no key is told "=?". The reply's text is sent back as the history, so a reply holding an id
    its text drops (a special id) re-renders to other ids: the second turn then starts a second sample."""
    messages = [{"role": "user", "content": record.text}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    reply = first.choices[0].message.content or ""
    call = reply[:1]
    shown = record.data["table"].get(call) if call else None
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"={shown or '?'}"}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    answer = (second.choices[0].message.content or "")[:1]
    score = lookup_score(asked=record.data["key"], call=call, shown=shown, answer=answer, call_credit=0.5,
                         digit_credit=0.0)
    return {"score": score, "called": float(call == record.data["key"])}
