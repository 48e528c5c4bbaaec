"""Prompts of the end-to-end tests."""

PROMPTS = [
    "The capital of France is",
    "Here is a list of three fruits: apple,",
    "Once upon a time, in a small village,",
    "The quick brown fox",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The three primary colors are",
    "In 1969, the first person to walk on the moon was",
    "A haiku about autumn:\n",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "The meaning of the word 'ephemeral' is",
    "My favourite programming language is Python because",
    "Q: What is 2 + 2?\nA:",
    "The Eiffel Tower is located in",
]
