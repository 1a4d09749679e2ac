"""Short chat prompts for the ``chat`` task, written for this repository (no data set)."""

from __future__ import annotations

__all__ = ["CHAT_PROMPTS"]

CHAT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain what a prime number is to a ten-year-old.",
    "Write a haiku about autumn rain.",
    "How do I boil an egg so the yolk stays soft?",
    "What is the difference between weather and climate?",
    "Suggest a name for a small bakery that sells bread and coffee.",
    "Write a short thank-you note to a neighbour who watered my plants.",
    "List five fruits that are rich in vitamin C.",
    "Why is the sky blue? Answer in two sentences.",
    "Write a Python function that returns the largest number in a list.",
    "What are the main parts of a plant cell?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Describe a calm beach at sunset in three sentences.",
    "What should I pack for a two-day hiking trip?",
    "Explain the rules of tic-tac-toe.",
    "Give me a simple recipe for a vegetable soup.",
    "What is photosynthesis?",
    "Write a limerick about a cat who loves cheese.",
    "How can I stay focused when studying at home?",
)
