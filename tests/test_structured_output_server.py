"""Structured output through the OpenAI API on the bundled model (Qwen2.5-Coder-0.5B-Instruct), driven by the
official openai client: every sampled answer at temperature 1 matches its pydantic model, regex or choice;
streamed answers equal whole ones; unconstrained neighbours are unaffected; bad constraints are 400s that name
the field."""
import asyncio
import json
import re

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from helpers import bundled_openai_client, bundled_openai_server  # noqa: F401 (fixtures client, server)
from helpers import wait_idle_and_clean as idle_and_clean

pytestmark = pytest.mark.slow
SAMPLES = 16


class Address(BaseModel):
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)


class Person(BaseModel):  # five fields, one of them nested: the typical schema
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    email: str = Field(max_length=60)
    languages: list[str] = Field(max_length=4)
    address: Address


def sample_concurrently(server, create, count=SAMPLES):
    """count concurrent requests (one batch in the engine), each made by create(async client)."""
    async def main():
        client = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*(create(client) for _ in range(count)))
    return asyncio.run(main())


def test_parse_returns_a_valid_instance_for_every_sample(server):
    messages = [{"role": "user", "content": "Invent a software developer and describe them as JSON."}]
    answers = sample_concurrently(server, lambda client: client.chat.completions.parse(
        model="qwen", messages=messages, response_format=Person, temperature=1.0, max_tokens=300))
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person), choice.message.content
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed
    assert len({a.choices[0].message.content for a in answers}) > 1, "temperature 1 gave one answer 16 times"
    idle_and_clean(server[1])


class Book(BaseModel):
    """Sorted, the open-ended list would come first. Not last: there the model ends the list with `"],` to go on
    to a property the schema does not have, the mask takes that token away, and the 0.5B model writes author
    after author until max_tokens, even greedy (docs/structured_output.md); the bounds end the title and year."""
    title: str = Field(max_length=60)
    authors: list[str]
    year: int = Field(ge=1000, le=2100)


NOVEL = "Describe a famous novel as JSON."


def test_parse_keeps_the_schemas_key_order_and_finishes(client):
    messages = [{"role": "user", "content": NOVEL}]
    answers = []
    for seed in range(8):
        choice = client.chat.completions.parse(model="qwen", messages=messages, response_format=Book, temperature=1.0,
                                               seed=seed, max_tokens=200).choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Book), choice.message.content
        assert list(json.loads(choice.message.content)) == ["title", "authors", "year"], choice.message.content
        answers.append(choice.message.content)
    assert len(set(answers)) > 1, "temperature 1 gave one answer 8 times"


def test_an_invalid_schema_is_a_400_naming_it_and_the_server_goes_on(server, client):
    bad = {"type": "json_schema", "json_schema": {"name": "book", "schema": {
        "type": "object", "properties": {"title": {"type": "strnig"}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "hi"}], response_format=bad)
    error = e.value.body
    assert error["param"] == "response_format" and "schema is invalid: Invalid type: strnig" in error["message"]
    choice = client.chat.completions.parse(model="qwen", messages=[{"role": "user", "content": NOVEL}],
                                           response_format=Book, temperature=0.0, max_tokens=200).choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Book)
    idle_and_clean(server[1])


@pytest.mark.parametrize("body", [{"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
                                  {"guided_regex": r"[0-9]{3}-[0-9]{4}"},
                                  {"structured_outputs": {"choice": ["red", "green", "blue"]}},
                                  {"guided_choice": ["red", "green", "blue"]}])
def test_regex_and_choice_as_vllm_users_send_them(client, body):
    messages = [{"role": "user", "content": "Make up a phone number, or name a colour."}]
    for seed in range(3):
        choice = client.chat.completions.create(model="qwen", messages=messages, temperature=1.0, seed=seed,
                                                max_tokens=20, extra_body=body).choices[0]
        constraint = body.get("guided_regex") or body.get("guided_choice") or next(iter(
            body["structured_outputs"].values()))
        text = choice.message.content
        assert choice.finish_reason == "stop", text
        assert text in constraint if isinstance(constraint, list) else re.fullmatch(constraint, text), text


def test_every_sample_matches_the_regex(server):
    regex = r"[A-Z][a-z]{2,9}, [0-9]{1,3} (years|months) old"
    answers = sample_concurrently(server, lambda client: client.completions.create(
        model="qwen", prompt="Name a pet and its age:", temperature=1.0, max_tokens=40,
        extra_body={"structured_outputs": {"regex": regex}}))
    for answer in answers:
        assert re.fullmatch(regex, answer.choices[0].text) and answer.choices[0].finish_reason == "stop"
    idle_and_clean(server[1])


def test_every_sample_is_one_of_the_choices(server):
    choices = ["Python", "Rust", "Go", "Haskell"]
    answers = sample_concurrently(server, lambda client: client.chat.completions.create(
        model="qwen", messages=[{"role": "user", "content": "Which language is best for a web server?"}],
        temperature=1.0, max_tokens=10, extra_body={"structured_outputs": {"choice": choices}}))
    assert all(a.choices[0].message.content in choices and a.choices[0].finish_reason == "stop" for a in answers)


def test_streamed_json_schema_answer_equals_the_whole_one(client):
    schema = {"name": "person", "schema": Person.model_json_schema()}
    kwargs = dict(model="qwen", messages=[{"role": "user", "content": "Describe a chemist as JSON."}],
                  temperature=0.0, max_tokens=300, response_format={"type": "json_schema", "json_schema": schema})
    # the prompt's whole blocks cached first, so that both answers compute the same uncached tail in the same
    # step: a step of other rows may take other kernels, whose float sums can tip a greedy near-tie
    client.chat.completions.create(**{**kwargs, "max_tokens": 1})
    whole = client.chat.completions.create(**kwargs).choices[0]
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        stream=True, **kwargs) if chunk.choices)
    assert whole.finish_reason == "stop" and streamed == whole.message.content
    Person.model_validate_json(streamed)


def test_json_object_on_completions_and_grammar_on_chat(client):
    answer = client.completions.create(model="qwen", prompt="A JSON object describing a cat:", max_tokens=120,
                                       temperature=0.0, extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(answer.choices[0].text), dict)
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    answer = client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": "What is 6 times 7?"}],
                                            max_tokens=20, temperature=0.0,
                                            extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"The answer is [0-9]+\.", answer.choices[0].message.content)


def test_unconstrained_request_is_unaffected_by_constrained_neighbours(server, client):
    plain = dict(model="qwen", messages=[{"role": "user", "content": "Write a haiku about the sea."}],
                 temperature=0.0, max_tokens=40)
    alone = client.chat.completions.create(**plain).choices[0].message.content

    async def main():
        client = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)
        constrained = [client.chat.completions.create(
            model="qwen", messages=[{"role": "user", "content": f"Describe person {i} as JSON."}], temperature=1.0,
            max_tokens=40, extra_body={"structured_outputs": {"json": Person.model_json_schema()}}) for i in range(3)]
        return await asyncio.gather(client.chat.completions.create(**plain), *constrained)
    together = asyncio.run(main())
    assert together[0].choices[0].message.content == alone


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "response_format.json_schema.schema is invalid"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs its json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "structured_outputs.regex is invalid"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs",
     "structured_outputs.grammar is invalid"),
    ({"structured_outputs": {"guided_regex": "a"}}, "structured_outputs", "unknown field"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "guided_regex is invalid"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "strnig"}}}}, "guided_json",
     "guided_json is invalid: Invalid type: strnig"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "response_format",
     "not both"),
])
@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_bad_constraints_are_400s_naming_the_field(server, endpoint, body, param, message):
    prompt = ({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat/completions"
              else {"prompt": "hi"})
    r = httpx.post(f"{server[0]}/v1/{endpoint}", json={"model": "qwen", "max_tokens": 5} | prompt | body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error
    idle_and_clean(server[1])
