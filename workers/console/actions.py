"""The console's actions: each a POST from one of its forms, by the same rules as the CLI's
commands (:class:`broker.operator.Operator`, :class:`broker.registry.Registry`).

Where the CLI asks before replaying work an agent may not be safe to repeat, the console
shows the same question as a page whose button confirms. The message actions go on the
message's timeline with who did them: ``console@<client address>``. Each action answers
with a redirect to the page it came from, carrying a notice of what was done (or why not).
"""

from __future__ import annotations

import logging
import math
from urllib.parse import quote

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from broker.errors import UnknownMessage
from broker.jsondepth import json_problem
from broker.operator import Action, Operator, ReplayPlan
from broker.registry import Registry

from .pages import state_of
from .state import ConsoleState, is_id

log = logging.getLogger("agent_reach.console")
MAX_REASON = 1000


def operator_name(request: Request) -> str:
    client = request.client.host if request.client else "unknown"
    return f"console@{client}"


def _back(state: ConsoleState, to: str, ok: bool, lines: list[str]) -> Response:
    key = state.leave_notice(ok, lines)
    joiner = "&" if "?" in to else "?"
    return RedirectResponse(f"{to}{joiner}notice={key}", status_code=303)


PAST = {"replay": "replayed", "resolve": "resolved", "cancel": "cancelled"}


def _reported(state: ConsoleState, to: str, actions: list[Action], verb: str) -> Response:
    if not actions:
        return _back(state, to, False, [f"nothing to {verb}"])
    lines = [f"{'' if a.done else 'not '}{PAST[verb]}: {a.detail}" for a in actions]
    return _back(state, to, all(a.done for a in actions), lines)


async def _confirm_or_replay(
    request: Request, plan: ReplayPlan, form: FormData, back: str
) -> Response:
    """Replay ``plan``; where it may repeat work, first a page that asks (as the CLI does)."""
    state = state_of(request)
    if plan.records and plan.unsafe and form.get("confirm") != "yes":
        return state.render(
            request,
            "confirm.html",
            page="",
            plan=plan,
            action=request.url.path,
            fields={k: str(v) for k, v in form.items() if k not in ("csrf", "confirm")},
            back=back,
        )
    actions = await Operator(state.conn).replay(plan, by=operator_name(request))
    return _reported(state, back, actions, "replay")


# -- messages --------------------------------------------------------------------------------


def _message_page(message_id: str) -> str:
    return f"/messages/{quote(message_id)}"


async def replay_message(request: Request) -> Response:
    state = state_of(request)
    message_id = request.path_params["message_id"]
    form = await request.form()
    try:
        if not is_id(message_id):
            raise UnknownMessage(message_id[:200])
        plan = await Operator(state.conn).plan_replay(
            [message_id], include_ended=form.get("include_ended") == "on"
        )
    except UnknownMessage as exc:
        return _back(state, "/messages", False, [str(exc)])
    return await _confirm_or_replay(request, plan, form, _message_page(message_id))


async def resolve_message(request: Request) -> Response:
    state = state_of(request)
    message_id = request.path_params["message_id"]
    back = _message_page(message_id)
    form = await request.form()
    outcome = form.get("outcome")
    text = str(form.get("value", "")).strip()
    if outcome == "succeeded":
        problem = json_problem(text)
        result, error = text.encode(), None
    elif outcome == "failed":
        problem = "give the reason it failed" if not text else None
        if len(text) > MAX_REASON:
            problem = f"a reason of at most {MAX_REASON} characters"
        result, error = None, text
    else:
        problem, result, error = "choose succeeded or failed", None, None
    if problem is not None:
        return _back(state, back, False, [f"not resolved: {problem}"])
    try:
        action = await Operator(state.conn).resolve(
            message_id, by=operator_name(request), result=result, error=error
        )
    except UnknownMessage as exc:
        return _back(state, "/messages", False, [str(exc)])
    return _reported(state, back, [action], "resolve")


async def cancel_message(request: Request) -> Response:
    state = state_of(request)
    message_id = request.path_params["message_id"]
    try:
        if not is_id(message_id):
            raise UnknownMessage(message_id[:200])
        action = await Operator(state.conn).cancel(message_id, by=operator_name(request))
    except UnknownMessage as exc:
        return _back(state, "/messages", False, [str(exc)])
    return _reported(state, _message_page(message_id), [action], "cancel")


# -- dead letters ----------------------------------------------------------------------------


async def replay_letters(request: Request) -> Response:
    """One dead letter's message (``id``), or every DEAD one whose reason is ``reason``
    (empty: all)."""
    state = state_of(request)
    form = await request.form()
    message_id = str(form.get("id", ""))
    reason = str(form.get("reason", ""))
    back = f"/dlq?reason={quote(reason)}" if reason else "/dlq"
    operator = Operator(state.conn)
    try:
        if message_id:
            if not is_id(message_id):
                raise UnknownMessage(message_id[:200])
            plan = await operator.plan_replay([message_id])
        else:
            plan = await operator.plan_dlq_replay(
                lambda letter: not reason or letter.reason == reason
            )
    except UnknownMessage as exc:
        return _back(state, back, False, [str(exc)])
    return await _confirm_or_replay(request, plan, form, back)


# -- instances -------------------------------------------------------------------------------


async def set_weight(request: Request) -> Response:
    state = state_of(request)
    instance = request.path_params["instance"]
    form = await request.form()
    try:
        weight = float(str(form.get("weight", "")))
    except ValueError:
        weight = math.nan
    if not (math.isfinite(weight) and 0 <= weight <= 1000):
        return _back(state, "/agents", False, ["a weight is a number from 0 to 1000"])
    if not is_id(instance) or not await Registry(state.conn).set_weight(instance, weight):
        return _back(state, "/agents", False, [f"no instance {instance[:200]}"])
    log.info("%s set the weight of %s to %g", operator_name(request), instance, weight)
    await state.sample()
    return _back(state, "/agents", True, [f"{instance}: weight {weight:g}"])


async def drain(request: Request) -> Response:
    state = state_of(request)
    instance = request.path_params["instance"]
    if not is_id(instance) or not await Registry(state.conn).drain(instance):
        return _back(state, "/agents", False, [f"no instance {instance[:200]}"])
    log.info("%s drained %s", operator_name(request), instance)
    await state.sample()
    return _back(
        state, "/agents", True, [f"{instance}: draining (it finishes its work, then leaves)"]
    )
