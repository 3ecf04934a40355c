"""The Responses API's `mcp` tool, run by the gateway for open models, as OpenAI defines it: each server's tools
are listed (an `mcp_list_tools` item, reused while the conversation holds one for the label), offered to the
model as functions, and called when the model asks (an `mcp_call` item); the outputs go back to the model, which
generates again, until it answers, or asks the client (a function call, an `mcp_approval_request`), or a bound
is reached (`McpSettings`: calls, time; past it the model answers without the tools, as OpenAI ignores calls
past `max_tool_calls`).

Every model turn is one journey through the pipeline (`dispatch`: guards, limits and budget, admission, the
model), so the model's arguments pass the output guards before a server gets them and a tool's output the input
guards before the model reads it (and the item shows it as the model read it); usage is every turn's, summed.
Which servers and tools a key may reach is `gateway.mcp.access`'s decision, the calls `gateway.mcp.client`'s; a
server's failure is an item's error, never an error status. A stream's refusals come before its first byte up to
the first model turn; after it, a failure is `response.failed`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from engine.types import Engine
from gateway.apis.chat.chat_serving import PreparedChat
from gateway.apis.responses.responses_serving import Joined, ResponsesService
from gateway.apis.responses.responses_wire import (
    FunctionTool,
    McpApprovalResponseInput,
    McpToolFilter,
    McpToolParam,
    ResponseEvents,
    ResponsesRequest,
    ToolChoiceFunction,
    ToolChoiceMcp,
    new_id,
)
from gateway.errors import APIError, ContentPolicyViolation, InvalidRequest
from gateway.guards.guarding import UNGUARDED, RequestGuard
from gateway.mcp import access, client
from gateway.mcp.access import Target
from gateway.pipeline.answer import Answer, Stream, Whole
from gateway.pipeline.context import RequestContext
from gateway.pipeline.dispatch import dispatch, policy_of
from gateway.pipeline.state import GatewayState
from gateway.protocol.openai import ChatCompletionRequest
from gateway.protocol.response_objects import (
    FunctionToolCall,
    IncompleteDetails,
    InputTokensDetails,
    Item,
    McpApprovalRequest,
    McpApprovalResponse,
    McpCall,
    McpCallError,
    McpListedTool,
    McpListTools,
    OutputItem,
    Response,
    ResponseUsage,
)
from gateway.stores.responses import OwnedResponses

Choice = Any  # a ResponsesRequest's tool_choice
PAST_BOUND = "Not called: the response's bound on tool calls (or its time) was reached."
MAX_SERVERS = 16  # mcp tools of one request: each is resolved, and listed, before the model's first turn


def applies(request: ResponsesRequest) -> bool:
    """Whether the request is this module's: it offers an mcp tool or answers an approval request."""
    items = request.input if isinstance(request.input, list) else []
    return any(isinstance(tool, McpToolParam) for tool in request.tools or []) or any(
        isinstance(item, McpApprovalResponseInput) for item in items)


async def answer(context: RequestContext, state: GatewayState, request: ResponsesRequest, mine: OwnedResponses,
                 history: list[Item], joined: Joined | None) -> Answer:
    """`history`: the previous response's conversation or the `conversation`'s items (`joined`, where the response
    goes once it ends), as a response without mcp tools reads them."""
    run = McpResponse(context, state, request, history, mine, joined)
    await run.check()
    if request.stream:
        return Stream(await run.begun())
    async for _ in run.run():
        pass
    return Whole(run.events_.response)


@dataclass(slots=True)
class Server:
    """One mcp tool of the request: where it is, and the tools the model is offered."""

    param: McpToolParam
    target: Target
    tools: dict[str, McpListedTool] = field(default_factory=dict)
    listed: bool = False  # by an earlier response of the conversation (not listed again)

    def allows(self, name: str, tool: McpListedTool | None) -> bool:
        """The request's allowed_tools."""
        allowed = self.param.allowed_tools
        if allowed is None or isinstance(allowed, list):
            return allowed is None or name in allowed
        return _matches(allowed, name, tool)

    def needs_approval(self, name: str) -> bool:
        """OpenAI's rule: approval by default; `never` spares the tools it names; `always` alone asks for its own."""
        rule = self.param.require_approval
        if rule is None or isinstance(rule, str):
            return rule != "never"
        tool = self.tools.get(name)
        if rule.never is not None and _names(rule.never) and _matches(rule.never, name, tool):
            return False
        if rule.always is not None and _names(rule.always) and _matches(rule.always, name, tool):
            return True
        return rule.never is not None or rule.always is None


def _names(given: McpToolFilter) -> bool:
    """Whether the filter names any tool (by name, or as the read-only ones)."""
    return given.tool_names is not None or bool(given.read_only)


def _matches(given: McpToolFilter, name: str, tool: McpListedTool | None) -> bool:
    """Whether the tool passes each condition of the filter: among its names; read-only, when it asks for that (as the
    server's listing marks it: readOnlyHint)."""
    if given.tool_names is not None and name not in given.tool_names:
        return False
    return not given.read_only or (tool is not None and (tool.annotations or {}).get("readOnlyHint") is True)


class McpTurn(ResponsesService):
    """One model turn of an MCP response: the conversation so far, answered whole through the pipeline (which
    stores nothing); `McpResponse` reads what it answers, and stores and streams the response itself."""

    guard: RequestGuard = UNGUARDED

    def prepare(self, request: ChatCompletionRequest, engine: Engine, default_max_tokens: int | None,
                guard: RequestGuard = UNGUARDED) -> PreparedChat:
        self.guard = guard  # the turn's: a tool's output is read through it too
        return super().prepare(request, engine, default_max_tokens, guard)


class McpResponse(ResponsesService):
    """One response with mcp tools (its id, fields, input items and store as any response's): `check` refuses
    before any byte, `run` runs it."""

    def __init__(self, context: RequestContext, state: GatewayState, request: ResponsesRequest, history: list[Item],
                 mine: OwnedResponses, joined: Joined | None) -> None:
        super().__init__(request, history, mine, joined)
        self.context, self.state = context, state
        self.settings = state.settings.mcp
        self.policy = policy_of(context, state)
        self.history = history
        self.servers: dict[str, Server] = {}
        self.functions: dict[str, tuple[Server, str]] = {}  # a function offered to the model: its server and tool
        self.approved: list[tuple[Server, McpApprovalRequest]] = []
        self.events_ = self.events = ResponseEvents(self.skeleton("in_progress"))
        self.guard: RequestGuard | None = None
        self.calls, self.turned, self.asked, self.called = 0, False, False, False
        self.usage = [0, 0, 0]  # input, output, cached input tokens of every turn
        most, bound = request.max_tool_calls, self.settings.max_calls_per_response
        self.most_calls = bound if most is None else min(bound, most)
        self.deadline = asyncio.get_running_loop().time() + self.settings.response_time_s

    # --- before the first byte ----------------------------------------------------------------

    async def check(self) -> None:
        if self.request.background:
            raise InvalidRequest("Responses with mcp tools are not run in the background here", "background")
        if sum(isinstance(tool, McpToolParam) for tool in self.request.tools or []) > MAX_SERVERS:
            raise InvalidRequest(f"At most {MAX_SERVERS} mcp tools in one request", "tools")
        for i, tool in enumerate(self.request.tools or []):
            if isinstance(tool, McpToolParam):
                await self._reach(tool, f"tools[{i}]")
        choice = self.request.tool_choice
        if isinstance(choice, ToolChoiceMcp) and choice.server_label not in self.servers:
            raise InvalidRequest(f"tool_choice names the mcp server '{choice.server_label}', which is not among "
                                 "the request's tools", "tool_choice")
        await self._check_approvals()

    async def _reach(self, tool: McpToolParam, at: str) -> None:
        label = tool.server_label
        if label in self.servers:
            raise InvalidRequest(f"Two mcp tools have the server_label '{label}'", f"{at}.server_label")
        if tool.connector_id is not None:
            raise InvalidRequest("Connectors are not available here: give the server's server_url", f"{at}.connector_id")
        headers = dict(tool.headers or {})
        if tool.authorization is not None:
            if any(name.lower() == "authorization" for name in headers):
                raise InvalidRequest("Give the server's token in authorization or in headers, not both",
                                     f"{at}.authorization")
            headers["Authorization"] = f"Bearer {tool.authorization}"
        try:
            target = await access.reach(self.policy, servers=self.state.mcp, server_label=label,
                                        server_url=tool.server_url, headers=headers)
        except APIError as error:
            error.param = f"{at}.{error.param}" if error.param else at
            raise
        server = self.servers[label] = Server(tool, target)
        for item in reversed(self.history):  # the conversation's listing, if it has one that worked
            if isinstance(item, McpListTools) and item.server_label == label and item.error is None:
                self._offer(server, item.tools)
                server.listed = True
                break

    async def _check_approvals(self) -> None:
        """Each approval answers a request of the previous response's (or of the `conversation`'s), once, for a server
        of this request."""
        given = [(i, item) for i, item in enumerate(self.request.input or [])
                 if isinstance(item, McpApprovalResponseInput)]
        if not given:
            return
        asked: list[Item] | list[OutputItem] = self.history if self.joined is not None else []
        if self.request.previous_response_id is not None:
            asked = (await self.mine.get(self.request.previous_response_id)).response.output
        asking = {item.id: item for item in asked if isinstance(item, McpApprovalRequest)}
        answered = {item.approval_request_id for item in self.history if isinstance(item, McpApprovalResponse)}
        for i, item in given:
            param, request_id = f"input[{i}].approval_request_id", item.approval_request_id
            request = asking.get(request_id)
            if request is None:
                raise InvalidRequest(f"No mcp_approval_request with id '{request_id}' in the previous response "
                                     "(previous_response_id) or the conversation", param)
            if request_id in answered:
                raise InvalidRequest(f"The mcp_approval_request '{request_id}' was answered already", param)
            answered.add(request_id)
            server = self.servers.get(request.server_label)
            if server is None:
                raise InvalidRequest(f"The approval's server '{request.server_label}' is not among this request's "
                                     "mcp tools", param)
            if item.approve:
                self.approved.append((server, request))

    # --- the run --------------------------------------------------------------------------------

    async def begun(self) -> AsyncGenerator[BaseModel, None]:
        """The stream, run up to its first model turn (its refusals are statuses, not events)."""
        run = self.run()
        ahead: list[BaseModel] = []
        async for event in run:
            ahead.append(event)
            if self.turned:
                break
        return _chained(ahead, run)

    async def run(self) -> AsyncGenerator[BaseModel, None]:
        events = self.events_  # stored once it ends (a refusal before the first byte leaves nothing stored)
        try:
            yield events.lifecycle("response.created")
            yield events.lifecycle("response.in_progress")
            async for event in self._run():
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            if not events.ended:
                await self.save(self._stopped(events))
            raise
        except Exception as exc:
            if not (self.request.stream and self.turned):
                raise  # before the first byte: the error's own status
            yield await self._failed(events, exc)

    async def _before(self) -> AsyncGenerator[BaseModel, None]:
        """The listings the conversation has not made yet, then the calls the client approved."""
        for server in self.servers.values():
            if not server.listed:
                async for event in self._list(server):
                    yield event
        for server, request in self.approved:
            async for event in self._call(server, request.name, request.arguments, request.id):
                yield event

    async def _run(self) -> AsyncGenerator[BaseModel, None]:
        async for event in self._before():
            yield event
        first = True
        while True:
            offer = self._may_call()
            turn = await self._turn(offer, self._choice(first, offer))
            first, self.turned, self.asked, self.called = False, True, False, False
            for item in turn.output:
                async for event in self._read(item):
                    yield event
            if self._left() == 0 and turn.status == "completed":  # max_output_tokens is every turn's: none left
                turn = turn.model_copy(update={"status": "incomplete", "completed_at": None,
                                               "incomplete_details": IncompleteDetails(reason="max_output_tokens")})
            if self.asked or not self.called or turn.status != "completed":
                async for event in self._ended(turn):
                    yield event
                return

    async def _read(self, item: OutputItem) -> AsyncGenerator[BaseModel, None]:
        """An item of a turn's output: a call of an mcp tool made (or its approval asked for), anything else
        passed on (a function call of the client's ends the response: the client runs it)."""
        called = self.functions.get(item.name) if isinstance(item, FunctionToolCall) else None
        if called is None or not isinstance(item, FunctionToolCall):
            self.asked = self.asked or isinstance(item, FunctionToolCall)
            for shown in self.events_.whole(item):
                yield shown
            return
        self.called = True  # a call past a bound is ignored, but the model still answers after it
        server, name = called
        if not self._may_call():
            return
        if server.needs_approval(name):
            self.asked, self.calls = True, self.calls + 1  # a call the client may approve: within the bound
            request = McpApprovalRequest(id=new_id("mcpr"), server_label=server.param.server_label, name=name,
                                         arguments=item.arguments)
            for shown in self.events_.whole(request):
                yield shown
            return
        async for event in self._call(server, name, item.arguments):
            yield event

    def _may_call(self) -> bool:
        return self.calls < self.most_calls and asyncio.get_running_loop().time() < self.deadline

    def _left(self) -> int | None:
        """The output tokens the next turn may generate: the request's max_output_tokens less every turn's."""
        most = self.request.max_output_tokens
        return None if most is None else max(0, most - self.usage[1])

    def _bound(self) -> float:
        """The seconds one server operation may take: its bound, within what is left of the response's."""
        return max(0.0, min(self.settings.timeout_s, self.deadline - asyncio.get_running_loop().time()))

    def _choice(self, first: bool, offer: bool) -> Choice:
        """The request's tool_choice for the first turn (an mcp tool's as the function it is offered as); after
        it, the model chooses (a forced call would be forced again for ever)."""
        choice = self.request.tool_choice
        if choice == "none" or (not first and choice is not None):
            return "none" if choice == "none" else "auto"
        if not isinstance(choice, ToolChoiceMcp):
            return choice
        server = self.servers[choice.server_label]
        if choice.name is None:
            return "required" if server.tools and offer else "auto"
        if choice.name not in server.tools or not offer:
            raise InvalidRequest(f"tool_choice names the tool '{choice.name}', which the mcp server "
                                 f"'{choice.server_label}' does not offer", "tool_choice")
        return ToolChoiceFunction(type="function", name=choice.name)

    async def _turn(self, offer: bool, choice: Choice) -> Response:
        """One generation through the pipeline, on the conversation so far; its charge settled to what it used,
        so that the next turn's is taken anew (limits and budgets hold per turn)."""
        functions = [tool for tool in self.request.tools or [] if isinstance(tool, FunctionTool)]
        if offer:
            functions += [FunctionTool(type="function", name=name, description=server.tools[tool].description,
                                       parameters=server.tools[tool].input_schema or None)
                          for name, (server, tool) in self.functions.items()]
        request = self.request.model_copy(update={
            "input": None, "tools": functions or None, "tool_choice": choice if functions or choice == "none" else None,
            "stream": False, "background": False, "store": False, "previous_response_id": None,
            "max_output_tokens": self._left(),
        })
        turn = McpTurn(request, [*self.items, *self.events_.response.output], self.mine)
        record = self.context.record
        before = (record.prompt_tokens or 0, record.completion_tokens or 0)
        await dispatch(self.context, self.state, turn.chat_request(), turn)
        charge, self.context.charge = self.context.charge, None
        if charge is not None:
            charge.settle((record.prompt_tokens or 0) - before[0], (record.completion_tokens or 0) - before[1])
        self.guard = turn.guard
        self.model, self.service_tier = turn.model, turn.service_tier
        assert turn.answer is not None
        if turn.answer.usage is not None:
            usage = turn.answer.usage
            self.usage[0] += usage.input_tokens
            self.usage[1] += usage.output_tokens
            self.usage[2] += usage.input_tokens_details.cached_tokens
        return turn.answer

    async def _ended(self, turn: Response) -> AsyncGenerator[BaseModel, None]:
        response = self.events_.response
        response.status, response.incomplete_details = turn.status, turn.incomplete_details
        response.completed_at, response.model, response.service_tier = turn.completed_at, turn.model, turn.service_tier
        details = InputTokensDetails(cached_tokens=self.usage[2])
        response.usage = ResponseUsage(input_tokens=self.usage[0], input_tokens_details=details,
                                       output_tokens=self.usage[1], total_tokens=self.usage[0] + self.usage[1])
        await self.save(response)
        yield self.events_.lifecycle("response.completed" if response.status == "completed" else "response.incomplete",
                                     response)

    # --- the servers ------------------------------------------------------------------------------

    def _offer(self, server: Server, tools: list[McpListedTool]) -> None:
        """The tools the model is offered: those the request and the key allow; a name a function of the
        request's, or an earlier server's tool, has already is not offered twice."""
        taken = {tool.name for tool in self.request.tools or [] if isinstance(tool, FunctionTool)}
        for tool in tools:
            if self._allowed(server, tool.name, tool):
                server.tools[tool.name] = tool
                if tool.name not in taken and tool.name not in self.functions:
                    self.functions[tool.name] = (server, tool.name)

    def _allowed(self, server: Server, name: str, tool: McpListedTool | None = None) -> bool:
        """The request's allowed_tools and the key's allow-list, which knows the server by the label `access.reach`
        found (the servers file's), never by the label the client gave it."""
        return (server.allows(name, tool or server.tools.get(name))
                and access.tool_allowed(self.policy, server.target.label, name))

    async def _list(self, server: Server) -> AsyncGenerator[BaseModel, None]:
        events, label = self.events_, server.param.server_label
        item = McpListTools(id=new_id("mcpl"), server_label=label)
        yield events.added(item)
        yield events.about("response.mcp_list_tools.in_progress", item.id)
        try:
            found = await client.list_tools(server.target, timeout_s=self._bound())
        except client.McpUnavailable as exc:
            item = item.model_copy(update={"error": str(exc)})
        else:
            self._offer(server, [McpListedTool(name=tool.name, description=tool.description,
                                               input_schema=tool.input_schema, annotations=tool.annotations)
                                 for tool in found])
            item = item.model_copy(update={"tools": list(server.tools.values())})
        yield events.about("response.mcp_list_tools.failed" if item.error else "response.mcp_list_tools.completed",
                           item.id)
        yield events.done(item)

    async def _call(self, server: Server, name: str, arguments: str,
                    approval: str | None = None) -> AsyncGenerator[BaseModel, None]:
        events = self.events_
        call = McpCall(id=new_id("mcp"), server_label=server.param.server_label, name=name, arguments="",
                       status="in_progress", approval_request_id=approval)
        yield events.added(call)
        yield events.about("response.mcp_call_arguments.delta", call.id, delta=arguments)
        yield events.about("response.mcp_call_arguments.done", call.id, arguments=arguments)
        yield events.about("response.mcp_call.in_progress", call.id)
        if self._may_call():  # always for the model's calls (`_read` asks first); an approved one may be past it
            self.calls += 1
            output, error = await self._outcome(server, name, arguments)
        else:
            output, error = None, McpCallError(type="mcp_tool_execution_error", content=PAST_BOUND)
        done = call.model_copy(update={"arguments": arguments, "output": output, "error": error,
                                       "status": "failed" if error else "completed"})
        yield events.about("response.mcp_call.failed" if error else "response.mcp_call.completed", call.id)
        yield events.done(done)

    async def _outcome(self, server: Server, name: str, arguments: str) -> tuple[str | None, McpCallError | None]:
        """The tool's output as the model will read it (through the input guards), or why there is none (the server's
        error text, read through them too)."""
        if not self._allowed(server, name):
            return None, McpCallError(type="http_error", code=403, message=f"The tool '{name}' is not allowed")
        try:
            given = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            given = None
        if not isinstance(given, dict):
            return None, McpCallError(type="mcp_protocol_error", code=-32602,
                                      message="The model's arguments are not a JSON object; the tool was not called")
        outcome = await client.call_tool(server.target, name, given, timeout_s=self._bound())
        guard = self.guard or self.state.guards.for_request(self.context.key_id, self.request.model,
                                                            log_content=self.context.record.log_content)
        try:  # the output (the client bounds it: cut, and said so) or the server's error text: the model reads either
            if outcome.output is None:
                error = guard.check_input([outcome.error or "no output"], "tools")[0]
                return None, McpCallError(type="mcp_tool_execution_error", content=error)
            return guard.check_input([outcome.output], "tools")[0], None
        except ContentPolicyViolation as refused:
            return None, McpCallError(type="mcp_tool_execution_error", content=refused.message)


async def _chained(ahead: list[BaseModel], rest: AsyncGenerator[BaseModel, None]) -> AsyncGenerator[BaseModel, None]:
    try:
        for event in ahead:
            yield event
        async for event in rest:
            yield event
    finally:
        await rest.aclose()
