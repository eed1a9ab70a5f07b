"""OpenAI request bodies (pydantic), and their translation to SamplingParams."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from qwenserve.config.errors import RequestError
from qwenserve.entrypoints.openai.tool_calls import forced_call_grammar
from qwenserve.sample.sampling_params import SamplingParams
from qwenserve.sample.structured_outputs import FIELD as STRUCTURED_OUTPUTS, StructuredOutputsParams

GUIDED, GUIDED_KINDS = "guided_", ("json", "regex", "choice", "grammar")  # vLLM's guided_json and the rest


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema: the schema and its name (strict is always so here: the grammar
    enforces the schema whatever it says)."""
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")  # OpenAI: absent means an empty schema
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None  # OpenAI's
    structured_outputs: dict | None = None  # vLLM's: one of json, regex, choice, grammar, json_object
    # vLLM's earlier fields, one per kind, which its users' code still sends (extra_body={"guided_regex": ...})
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def constraint_field(self) -> str:
        """The request field a complaint about the output constraint is reported against."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        if self.forces_tool_calls:
            return "tool_choice"
        return next((f"{GUIDED}{kind}" for kind in GUIDED_KINDS if getattr(self, GUIDED + kind) is not None),
                    STRUCTURED_OUTPUTS)

    @property
    def named_tool(self) -> str | None:
        """The function a named tool_choice names, or None."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def forces_tool_calls(self) -> bool:
        return False  # only chat requests take tools

    def _response_format_constraint(self) -> StructuredOutputsParams | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None:
            raise RequestError("response_format of type json_schema needs its json_schema", param="response_format")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)

    def structured_outputs_params(self, forced_calls: StructuredOutputsParams | None = None
                                  ) -> StructuredOutputsParams | None:
        """The output constraint, from response_format, structured_outputs or forced_calls, the grammar of a
        forced tool call (only one: the others would be dropped)."""
        found = []
        try:
            from_format = self._response_format_constraint()
        except RequestError as e:
            raise RequestError(str(e).replace(STRUCTURED_OUTPUTS, "response_format"), param="response_format") from e
        if from_format is not None:
            found.append(("response_format", from_format))
        if self.structured_outputs is not None:
            found.append((STRUCTURED_OUTPUTS, StructuredOutputsParams.from_dict(self.structured_outputs)))
        for kind in GUIDED_KINDS:
            field = GUIDED + kind
            if getattr(self, field) is not None:
                try:
                    found.append((field, StructuredOutputsParams(**{kind: getattr(self, field)})))
                except RequestError as e:
                    raise RequestError(str(e).replace(f"{STRUCTURED_OUTPUTS}.{kind}", field), param=field) from e
        if forced_calls is not None:
            found.append(("a forced tool_choice", forced_calls))
        if len(found) > 1:
            raise RequestError(f"give {' or '.join(name for name, _ in found)}, not both: each constrains the output",
                               param=found[0][0].split()[-1])
        return found[0][1] if found else None

    def _sampling(self, max_tokens: int | None, logprobs: int | None, defaults: dict,
                  forced_calls: StructuredOutputsParams | None = None) -> SamplingParams:
        def pick(name: str, fallback):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
            n=self.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0), presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, repetition_penalty=pick("repetition_penalty", 1.0),
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs_params(forced_calls))


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    tools: list | None = None  # refused: a prompt has no template to show tools in
    tool_choice: str | dict | None = None

    def sampling_params(self, defaults: dict) -> SamplingParams:
        if self.tools is not None or self.tool_choice is not None:
            raise RequestError("tools and tool_choice are for chat completions (/v1/chat/completions), which show "
                               "them to the model through its chat template; completions take a plain prompt",
                               param="tools" if self.tools is not None else "tool_choice")
        params = self._sampling(self.max_tokens, self.logprobs, defaults)
        if self.echo and self.logprobs is not None:  # echo returns the prompt's logprobs too
            params.prompt_logprobs = self.logprobs
        return params


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None
    # an assistant turn's reasoning, which thinking models' templates render (vLLM's names: the newer is
    # `reasoning`)
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's: the final message is left open for the answer to continue (add_generation_prompt false)
    continue_final_message: bool = False
    # vLLM's: the answer's content starts with the final message's where that is the assistant's
    echo: bool = False
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: e.g. {"enable_thinking": false} for Qwen3

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value):
        return check_template_kwargs(value)

    @property
    def echoed(self) -> str:
        """What echo puts before the answer's content: the final message's text where it is the assistant's."""
        last = self.messages[-1]
        return (last.text() or "") if self.echo and last.role == "assistant" else ""

    @property
    def tools_in_use(self) -> list[dict] | None:
        """The tools shown to the model (and whose calls are parsed from its answer); none with tool_choice none."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def named_tool(self) -> str | None:
        """The function a named tool_choice names, or None."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def forces_tool_calls(self) -> bool:
        """tool_choice is "required" or names a function: the answer is held to a grammar of calls."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice))

    def forced_tools(self) -> list[dict] | None:
        """The tools one of which the answer must call ("required": any of them; a named function: that one),
        or None when tool_choice forces no call. Checks tools and tool_choice (RequestError naming the field)."""
        if self.tool_choice not in (None, "none") and not self.tools:  # "none" needs none, as vLLM takes it
            raise RequestError("tool_choice needs tools to choose from", param="tool_choice")
        if not self.tools:
            return None
        names = [tool.function.name for tool in self.tools]
        if len(set(names)) < len(names):
            raise RequestError(f"tools has functions of the same name: {sorted(names)}", param="tools")
        only = self.named_tool
        if only is not None and only not in names:
            raise RequestError(f"tool_choice names the function {only!r}, which is not among the tools "
                               f"({', '.join(names)})", param="tool_choice")
        if not self.forces_tool_calls:
            return None
        return [tool for tool in self.tools_in_use if only is None or tool["function"]["name"] == only]

    def sampling_params(self, defaults: dict, tool_tag_ids: tuple[int, int] | None = None) -> SamplingParams:
        """tool_tag_ids: the ids of the tokenizer's `<tool_call>` and `</tool_call>` tokens, which a forced call's
        grammar names (tool_calls.tag_token_ids; the server knows the tokenizer, the request does not)."""
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        forced = self.forced_tools()
        # a named function is called once, as OpenAI and vLLM do; "required" takes as many calls as the model makes
        parallel = self.parallel_tool_calls and not isinstance(self.tool_choice, NamedToolChoice)
        forced_calls = None if forced is None else StructuredOutputsParams(
            grammar=forced_call_grammar(forced, parallel, tool_tag_ids))
        return self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, defaults,
                              forced_calls)


# apply_chat_template's own arguments: chat_template_kwargs may not set them (the server does)
_TEMPLATE_ARGUMENTS = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                       "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")

# the chat template switches chat_template_kwargs may set, which must be booleans (Qwen3's)
_TEMPLATE_SWITCHES = ("enable_thinking",)


def check_template_ending(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """The prompt ends either by opening the assistant's turn or by leaving the final message open, not both."""
    if add_generation_prompt and continue_final_message:
        raise RequestError("continue_final_message and add_generation_prompt cannot both be true: set "
                           "add_generation_prompt to false to continue the final message",
                           param="continue_final_message")


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs: more variables for the chat template (Qwen3's enable_thinking), none of them one the
    server sets itself."""
    taken = sorted(k for k in kwargs or () if k in _TEMPLATE_ARGUMENTS)
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: the server sets "
                         f"{'it' if len(taken) == 1 else 'them'} from the request's own fields")
    for name in _TEMPLATE_SWITCHES:
        # the template tests the value's truth: the string "false" would leave thinking on
        if name in (kwargs or {}) and not isinstance(kwargs[name], bool):
            raise ValueError(f"chat_template_kwargs.{name} must be true or false, got {kwargs[name]!r}")
    return kwargs


class TokenizeRequest(BaseModel):
    """vLLM's: a prompt's tokens, or a conversation's as chat completions run it (content parts with images and
    videos on a vision-language model, each placeholder expanded to its size in tokens)."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # as ChatCompletionRequest's
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, value):
        return check_template_kwargs(value)


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's): serve the PEFT adapter at lora_path under the model name lora_name."""
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's)."""
    lora_name: str = Field(min_length=1)
