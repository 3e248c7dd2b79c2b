"""Agent apps against an OpenAI client: the openai package is needed for every test here."""

from __future__ import annotations

import pytest

pytest.importorskip("openai")
