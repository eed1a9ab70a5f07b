"""OpenAI request bodies (pydantic), and their translation to SamplingParams."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from qwenserve.config.errors import RequestError
from qwenserve.sample.sampling_params import SamplingParams
from qwenserve.sample.structured_outputs import FIELD as STRUCTURED_OUTPUTS, StructuredOutputsParams


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

    @property
    def constraint_field(self) -> str:
        """The request field a complaint about the output constraint is reported against."""
        return "response_format" if self._response_format_constraint() is not None else STRUCTURED_OUTPUTS

    def _response_format_constraint(self) -> StructuredOutputsParams | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None:
            raise RequestError("response_format of type json_schema needs its json_schema", param="response_format")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint, from response_format or structured_outputs (not both: one would be dropped)."""
        try:
            from_format = self._response_format_constraint()
        except RequestError as e:
            raise RequestError(str(e).replace(STRUCTURED_OUTPUTS, "response_format"), param="response_format") from e
        if from_format is not None and self.structured_outputs is not None:
            raise RequestError("give response_format or structured_outputs, not both", param="response_format")
        if self.structured_outputs is not None:
            return StructuredOutputsParams.from_dict(self.structured_outputs)
        return from_format

    def _sampling(self, max_tokens: int | None, logprobs: int | None, defaults: dict) -> SamplingParams:
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
            structured_outputs=self.structured_outputs_params())


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def sampling_params(self, defaults: dict) -> SamplingParams:
        params = self._sampling(self.max_tokens, self.logprobs, defaults)
        if self.echo and self.logprobs is not None:  # echo returns the prompt's logprobs too
            params.prompt_logprobs = self.logprobs
        return params


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def sampling_params(self, defaults: dict) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        return self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, defaults)


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
