"""LangChain's standard test suites (langchain-tests) for ChatPrefixRT.

Unit tests need no model (construction is lazy). Integration tests run on Gemma-3-270M, in-process and (once
RemoteEngine exists) through a live `prefixrt serve`. Tests that judge answer quality beyond a 270M base model
are skipped with their reason (docs/adapters.md lists them).
"""

from __future__ import annotations

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from prefixrt.adapters.langchain import ChatPrefixRT
from tests.adapters.conftest import needs_constraints


class TestChatPrefixRTUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self):
        return ChatPrefixRT

    @property
    def chat_model_params(self):
        return {"model": "gemma-3-270m"}

    @property
    def supports_json_mode(self):
        return True

    @property
    def init_from_env_params(self):
        return {"PREFIXRT_API_KEY": "key-from-env"}, {"base_url": "http://127.0.0.1:30000"}, {"api_key": "key-from-env"}
