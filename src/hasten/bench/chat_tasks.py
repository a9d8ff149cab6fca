"""Chat benchmark prompts for instruction-tuned models, written by the project.

The categories follow Spec-Bench (multi-turn conversation, translation, summarisation,
question answering, math reasoning, retrieval-augmented answering) plus two tasks whose
answers copy most of their input (code editing and grammar correction), where drafting
from the prompt pays most. Each prompt is a list of chat messages; the model's own chat
template turns it into input ids, exactly as ``Engine.chat`` and Hugging Face do. The
prompts are short enough for a 135M model on a CPU: about 100-400 tokens each.
"""
from __future__ import annotations

import torch

from .tasks import Task

SOURCE = "hasten chat prompts"


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


CONVERSATION = (
    (
        _user("I am going on a weekend trip to a small town by the sea. What should I pack?"),
        _assistant(
            "For a weekend by the sea, pack:\n1. Comfortable walking shoes and sandals.\n"
            "2. Light clothes for the day and a warm sweater for the evening.\n"
            "3. Sunscreen, sunglasses and a hat.\n4. A swimsuit and a beach towel.\n"
            "5. A small backpack for day trips.\n6. Your phone charger and a book for the train."
        ),
        _user(
            "Thanks! The forecast now says it will rain all Saturday. Please rewrite your packing list "
            "for rainy weather, keeping the same numbered format, and then suggest two things to do indoors."
        ),
    ),
    (
        _user("How often should I water my houseplants? I have a snake plant, a fern and a small cactus."),
        _assistant(
            "Each of those plants likes something different. The snake plant is very tolerant: water it "
            "every two to three weeks and let the soil dry out completely between waterings. The fern "
            "likes moist soil, so water it whenever the top of the soil feels dry, usually twice a week, "
            "and mist its leaves if your home is dry. The cactus needs the least water: once a month in "
            "spring and summer, and almost never in winter. For all three, make sure the pot has a hole "
            "in the bottom so extra water can drain away."
        ),
        _user("Great. Now turn your advice into three short rules, one per plant, that I can stick on my fridge."),
    ),
)

TRANSLATION = (
    (
        _user(
            "Translate the following text from English into French.\n\n"
            "Dear neighbours, next Saturday we are organising a clean-up of the park behind the school. "
            "We will meet at nine o'clock in the morning near the main gate. Please bring gloves and, if "
            "you can, a rake or a broom. Bags and drinks will be provided. After the work, everyone is "
            "invited to a small picnic by the pond. Children are welcome. Thank you for helping to keep "
            "our neighbourhood clean and green!"
        ),
    ),
    (
        _user(
            "Translate this text into Spanish.\n\n"
            "The museum is open every day except Monday, from ten in the morning until six in the "
            "evening. Tickets cost eight euros for adults and are free for children under twelve. On "
            "the first Sunday of every month, entry is free for everyone. Guided tours in English start "
            "at eleven o'clock and at three o'clock. Please leave large bags in the lockers near the "
            "entrance. Photographs are allowed, but without flash."
        ),
    ),
)

SUMMARY = (
    (
        _user(
            "Summarize the following article in three sentences.\n\n"
            "The town library reopened on Monday after a renovation that lasted fourteen months. The old "
            "building, which dates from 1923, had a leaking roof, poor heating and no lift, so many older "
            "readers could not reach the upper floor. The renovation added a new roof, solar panels, a lift "
            "and a bright reading room for children. The library also has forty new computers that anyone "
            "with a library card can use for free. The work cost 2.3 million euros, paid for partly by the "
            "town and partly by a national grant for public buildings. On the first day, more than six "
            "hundred people visited, and the librarians say that four hundred new cards were issued in the "
            "first week. The mayor said the library is now ready for another hundred years. Opening hours "
            "have also been extended: the library now stays open until eight o'clock on weekdays."
        ),
    ),
    (
        _user(
            "Here are the notes from our team meeting. Summarize the decisions and the action items.\n\n"
            "Attendees: Ana, Ben, Chloe, David.\n"
            "- The website launch moves from March 3 to March 17 because the payment page is not ready.\n"
            "- Ben will finish the payment page by March 10 and ask Chloe to test it.\n"
            "- Chloe reported that the mobile menu is broken on small screens; she will fix it this week.\n"
            "- David wants a short video for the home page. The team agreed to use the budget left from "
            "the photo shoot. David will contact two video studios and report back on Friday.\n"
            "- Ana will write the launch announcement and send a draft to everyone by March 12.\n"
            "- Next meeting: Thursday at 10:00."
        ),
    ),
)

QUESTION_ANSWERING = (
    (
        _user(
            "My daughter asked me why the sky is blue during the day but turns red and orange at sunset, "
            "and I could not explain it well. She is ten years old and likes science. Can you explain what "
            "happens to sunlight in the air, why blue light is scattered more than red light, and why the "
            "colours change when the sun is low? Please use simple words and one everyday comparison."
        ),
    ),
    (
        _user(
            "What is the difference between weather and climate? I often hear people say that a cold week "
            "proves the climate is not getting warmer. Explain the difference with an example, and say "
            "how many years of data scientists usually look at when they talk about climate."
        ),
    ),
)

MATH = (
    (
        _user(
            "Solve this problem step by step.\n\n"
            "A bakery sells muffins for 3 dollars each and cookies for 2 dollars each. On Monday it sold "
            "45 muffins and 60 cookies. On Tuesday it sold twice as many muffins as on Monday but 15 fewer "
            "cookies. How much money did the bakery make on the two days together?"
        ),
    ),
    (
        _user(
            "Answer the question and show your reasoning.\n\n"
            "A train leaves the station at 9:40 and travels at 80 kilometres per hour. The distance to the "
            "next city is 200 kilometres. The train stops for 15 minutes halfway. At what time does it "
            "arrive in the next city?"
        ),
    ),
)

RAG = (
    (
        _user(
            "Use only the documents below to answer the question.\n\n"
            "Document 1: The Riverside Community Garden has 48 plots. Each plot is 3 metres by 4 metres and "
            "costs 25 euros per year. Water is included in the price.\n"
            "Document 2: To rent a plot, residents must fill in the form at the town hall and show proof of "
            "address. The waiting list is currently about six months long.\n"
            "Document 3: Garden members must keep their plot tidy, may not use chemical pesticides, and must "
            "help at two shared work days each year, in April and in October.\n\n"
            "Question: How big is a plot at the Riverside Community Garden, how much does it cost, and what "
            "do I need to do to get one?"
        ),
    ),
    (
        _user(
            "Answer the question using the passages. Quote the passage you used.\n\n"
            "Passage A: The Blue Line bus runs from the central station to the airport every 20 minutes "
            "between 5:00 and 23:00. The trip takes about 35 minutes and a ticket costs 4 euros.\n"
            "Passage B: The airport train leaves the central station every 15 minutes between 6:00 and "
            "midnight. The trip takes 18 minutes and a ticket costs 9 euros.\n"
            "Passage C: Taxis to the airport cost about 40 euros and take 25 minutes without traffic.\n\n"
            "Question: I need to reach the airport from the central station at 5:30 in the morning and I "
            "want to spend as little as possible. Which option should I take, and how long will it take?"
        ),
    ),
)

CODE_EDIT = (
    (
        _user(
            "Rename the variable `items` to `orders` in this Python function and add a one-line docstring. "
            "Return the whole function.\n\n"
            "```python\n"
            "def total_price(items, tax_rate):\n"
            "    subtotal = 0\n"
            "    for item in items:\n"
            "        subtotal += item.price * item.quantity\n"
            "    if subtotal > 100:\n"
            "        subtotal = subtotal * 0.95\n"
            "    tax = subtotal * tax_rate\n"
            "    return round(subtotal + tax, 2)\n"
            "```"
        ),
    ),
    (
        _user(
            "Fix the bug in this function: it should return the largest number in the list, and None for an "
            "empty list. Return the corrected code only.\n\n"
            "```python\n"
            "def largest(numbers):\n"
            "    best = 0\n"
            "    for number in numbers:\n"
            "        if number > best:\n"
            "            best = number\n"
            "    return best\n"
            "```"
        ),
    ),
)

GRAMMAR = (
    (
        _user(
            "Correct the grammar and spelling mistakes in this text. Return only the corrected text.\n\n"
            "Yesterday me and my brother goes to the market for buying some vegetables. It were very "
            "crowded because it was the last day before the holiday. We buyed tomatos, onions and a big "
            "pumpkin, but we forgot to bring a bag, so we has to carry everything in our hands. When we "
            "arrived home, my mother were very happy and she cooked a delicious soup for all the family."
        ),
    ),
    (
        _user(
            "Please fix the errors in this email and keep the meaning the same.\n\n"
            "Hello Mr. Smith, I am writting to inform you that the package you was expecting have been "
            "delayed. The delivery company told us that it will arrive on thursday instead of tuesday. "
            "We are very sorry for the inconvenience and we will refund the shipping cost. If you has any "
            "questions, dont hesitate to contact me. Best regards, Laura"
        ),
    ),
)

PROMPTS: dict[str, tuple[tuple[dict[str, str], ...], ...]] = {
    "conversation": CONVERSATION,
    "translation": TRANSLATION,
    "summary": SUMMARY,
    "qa": QUESTION_ANSWERING,
    "math": MATH,
    "rag": RAG,
    "code_edit": CODE_EDIT,
    "grammar": GRAMMAR,
}
CHAT_CATEGORIES = tuple(PROMPTS)


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_input_ids(tokenizer, messages) -> torch.Tensor:
    """``messages`` through the chat template with the assistant's turn opened: ids [1, T].
    The template writes its own BOS, as in ``Engine.encode_chat`` and Hugging Face."""
    encoded = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    return encoded["input_ids"]  # [1, T]


def task_input_ids(tokenizer, task: Task) -> torch.Tensor:
    """A task's input ids [1, T]: chat tasks through the template, plain prompts as text."""
    if task.messages:
        return chat_input_ids(tokenizer, task.messages)
    return tokenizer(task.prompt, return_tensors="pt").input_ids  # [1, T]


def plain_transcript(messages) -> str:
    """A conversation as plain text, for base models without a chat template; ends where the
    assistant's answer begins."""
    turns = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n\n".join([*turns, "Assistant:"])


def chat_tasks(tokenizer, categories=CHAT_CATEGORIES, per_task: int = 2) -> list[Task]:
    """The first ``per_task`` conversations of each category, templated for ``tokenizer``; a
    tokenizer without a chat template (a base model) gets them as plain transcripts."""
    unknown = [c for c in categories if c not in PROMPTS]
    if unknown:
        raise ValueError(f"unknown chat task categories {unknown}; known: {', '.join(CHAT_CATEGORIES)}")
    most = min(len(p) for p in PROMPTS.values())
    if not 1 <= per_task <= most:
        raise ValueError(f"--per-task must be between 1 and {most} for the chat tasks, got {per_task}")
    tasks = []
    for category in CHAT_CATEGORIES:  # fixed order, whatever order they were asked in
        if category not in categories:
            continue
        for j, messages in enumerate(PROMPTS[category][:per_task]):
            tasks.append(chat_task(tokenizer, f"{category}-{j + 1}", category, messages, SOURCE))
    return tasks


def chat_task(tokenizer, name: str, category: str, messages, source: str) -> Task:
    """One conversation as a task: through the model's chat template (the assistant's turn
    opened), or as a plain transcript for a tokenizer without one (a base model)."""
    messages = tuple(messages)
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return Task(name, category, text, source, chat_input_ids(tokenizer, messages).shape[1], messages)
    text = plain_transcript(messages)
    count = len(tokenizer(text).input_ids)  # as task_input_ids encodes it
    return Task(name, category, text, f"{source}, plain text (no chat template)", count)
