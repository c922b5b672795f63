"""Seeded generator of the chat data: small talk and simple Q&A, short stories, and tool-call
dialogues (get_weather, calculator, get_time) in Qwen's `<tool_call>` JSON format, as
OpenAI-style message lists (rendered later with the model's chat template).

The weather evaluation set uses cities and phrasings that never occur in the training dialogues.
"""
from __future__ import annotations

import json
import random

# ---------------------------------------------------------------- tools

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"],
                         "description": "The temperature unit"},
            },
            "required": ["location"],
        },
    },
}
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string",
                               "description": "The expression to evaluate, e.g. 2 * (3 + 4)"},
            },
            "required": ["expression"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string", "description": "The city name"}},
            "required": ["location"],
        },
    },
}
# The tool list the evaluation (and the server test) offers.
EVAL_TOOLS = [WEATHER_TOOL, CALCULATOR_TOOL]

# ---------------------------------------------------------------- cities

TRAIN_CITIES_EXTRA = """Sydney Melbourne Brisbane Perth Adelaide Toronto Vancouver Montreal
New_York Los_Angeles San_Francisco Seattle Boston Miami Houston Dallas Denver Atlanta Phoenix
Philadelphia Detroit Las_Vegas Portland Austin Nashville New_Orleans Honolulu Anchorage
Minneapolis St._Louis San_Antonio Manchester Liverpool Birmingham Glasgow Edinburgh Leeds Bristol
Cardiff Belfast Cork Galway Lyon Nice Bordeaux Toulouse Nantes Munich Hamburg Frankfurt Cologne
Stuttgart Zurich Geneva Basel Milan Naples Florence Venice Turin Verona Porto Seville Valencia
Bilbao Malaga Rotterdam Antwerp Ghent Gothenburg Bergen Trondheim Krakow Gdansk Wroclaw Salzburg
Innsbruck St._Petersburg Novosibirsk Istanbul Izmir Antalya Dubai Abu_Dhabi Mumbai Kolkata Chennai
Bangalore Hyderabad Karachi Lahore Shanghai Hong_Kong Guangzhou Shenzhen Chengdu Kyoto Yokohama
Sapporo Busan Ho_Chi_Minh_City Cebu Surabaya Auckland Queenstown Cape_Town Johannesburg
Casablanca Marrakesh Alexandria Lagos Mombasa Zanzibar Sao_Paulo Rio_de_Janeiro Salvador
Cordoba Medellin Cartagena Guadalajara Monterrey Cancun Valparaiso Cusco Reykjavik Tromso
Dubrovnik Split Thessaloniki Heraklion Odessa Lviv Tbilisi Almaty Samarkand Chiang_Mai Phuket
Penang Bali Darjeeling Goa Agra Varanasi Cairns Alice_Springs""".split()
TRAIN_CITIES_EXTRA = [c.replace("_", " ") for c in TRAIN_CITIES_EXTRA]

EVAL_CITIES = """Marseille Osaka Chicago Barcelona San_Diego Calgary Edmonton Winnipeg Baltimore
Pittsburgh Cleveland Sacramento Salt_Lake_City Tampa Orlando Charlotte Kansas_City Newcastle
Nottingham Sheffield Aberdeen Dresden Leipzig Nuremberg Bologna Palermo Granada Zaragoza Utrecht
Malmo Tampere Lille Strasbourg Nagoya Fukuoka Pune Jaipur Hobart Christchurch Durban""".split()
EVAL_CITIES = [c.replace("_", " ") for c in EVAL_CITIES]

ONSETS = ["b", "br", "c", "ch", "d", "dr", "f", "g", "gr", "h", "j", "k", "kr", "l", "m", "n",
          "p", "pr", "r", "s", "sh", "st", "t", "tr", "v", "w", "z", "", "", "qu", "th", "y"]
VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ai", "ou", "ea", "io", "y"]
CODAS = ["", "", "", "n", "r", "l", "s", "m", "nd", "rg", "x", "k", "t", "sh", "ck"]
AFFIXES = ["Port {}", "{} Falls", "New {}", "San {}", "{} City", "Lake {}", "Saint {}",
           "{} Springs", "{} Bay", "North {}", "{}ville", "{}burg", "{}ton", "El {}", "{} Heights",
           "Mount {}", "{}-on-Sea", "Fort {}", "{} Harbour", "Las {}"]


class Places:
    """Location names for the tool dialogues. Real cities alone are a closed set that a small model
    memorises (it then answers with a known city instead of copying the asked one), so most
    names are invented (syllables, or English words) to make copying the only way to be right."""

    def __init__(self, real, words, banned):
        self.real, self.words = real, words
        self.banned = {b.lower() for b in banned}

    def _syllables(self, rng):
        n = rng.choice([1, 2, 2, 2, 3, 3, 4])
        w = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(n))
        return w[:1].upper() + w[1:]

    def __call__(self, rng):
        while True:
            r = rng.random()
            if r < 0.3:
                p = rng.choice(self.real)
            elif r < 0.65:
                p = self._syllables(rng)
                if rng.random() < 0.3:
                    p = rng.choice(AFFIXES).format(p)
                elif rng.random() < 0.1:
                    p = p + " " + self._syllables(rng)
            else:
                p = rng.choice(self.words)
                if rng.random() < 0.4:
                    p = rng.choice(AFFIXES).format(p)
                elif rng.random() < 0.3:
                    p = p + " " + rng.choice(self.words)
            if len(p) >= 3 and p.lower() not in self.banned:
                return p


# ---------------------------------------------------------------- phrasings

WEATHER_TRAIN = [
    "What is the weather in {c}?", "What's the weather like in {c}?",
    "What's the weather in {c} today?", "How is the weather in {c}?",
    "Is it raining in {c} right now?", "Is it sunny in {c}?", "weather for {c} please",
    "weather in {c}", "{c} weather?", "Tell me the weather in {c}.",
    "Can you check the weather in {c}?", "Could you tell me the current weather in {c}?",
    "How hot is it in {c}?", "How cold is it in {c} right now?",
    "What's the temperature in {c}?", "Do I need an umbrella in {c} today?",
    "Will it snow in {c} today?", "Is it windy in {c}?", "I'm in {c}. What's the weather like?",
    "Check the weather in {c} for me.", "what is the temperature in {c} now",
    "Hi! What's the weather in {c}?", "Please get the current weather for {c}.",
    "Current conditions in {c}?", "How's the weather in {c} at the moment?",
    "Is it cold in {c}?", "What is it like outside in {c}?", "Weather {c}",
    "Can you tell me if it's raining in {c}?", "I need the weather for {c}.",
    "Do I need a coat in {c}?", "Should I wear sunscreen in {c} today?",
    "Is it warm in {c} today?", "What's the forecast for {c}?", "Is the weather good in {c}?",
    "How's it looking outside in {c}?", "Look up the weather in {c}.",
    "Can you find out the weather in {c}?", "I'm visiting {c} tomorrow. Is it cold there?",
    "Tell me about the weather in {c} right now.", "Is it foggy in {c}?",
    "Get me the temperature for {c}.", "What's it like in {c} today, weather-wise?",
]
PREFIXES = ["", "", "", "", "Hi! ", "Hello. ", "Hey, ", "Quick question: ", "Good morning! ",
            "Sorry to bother you. ", "I'm planning my day. "]
SUFFIXES = ["", "", "", "", " Thanks!", " Thank you.", " Please."]
WEATHER_UNIT_TRAIN = [
    ("What's the weather in {c} in Fahrenheit?", "fahrenheit"),
    ("What is the temperature in {c} in fahrenheit?", "fahrenheit"),
    ("How warm is it in {c}, in degrees Fahrenheit?", "fahrenheit"),
    ("Weather in {c} in celsius please", "celsius"),
    ("What's the temperature in {c} in Celsius?", "celsius"),
    ("Tell me the weather in {c}, in Celsius.", "celsius"),
]
WEATHER_EVAL = [  # phrasings held out of training
    "Any idea what the weather is doing in {c}?",
    "I'm heading to {c} later. How's the weather there?",
    "Give me the weather report for {c}.",
    "What are the current weather conditions in {c}?",
    "Should I bring a jacket in {c} today?",
    "Is it nice out in {c}?",
]
WEATHER_UNIT_EVAL = [("Weather in {c} in fahrenheit, please.", "fahrenheit"),
                     ("How many degrees Celsius is it in {c}?", "celsius")]

CONDITIONS = ["sunny", "clear", "partly cloudy", "cloudy", "overcast", "light rain", "rain",
              "heavy rain", "thunderstorms", "drizzle", "fog", "light snow", "snow", "windy",
              "hazy", "showers"]


def _kind(template: str) -> str:
    t = template.lower()
    for k in ("umbrella", "rain", "snow", "sunny", "windy", "hot", "cold", "warm"):
        if k in t:
            return k
    return "general"


def _weather_answer(rng, c, r, kind):
    t, u, cond, hum, wind = r["temperature"], r["unit"], r["condition"], r["humidity"], r["wind_kph"]
    U = "C" if u == "celsius" else "F"
    desc = f"{t}°{U} and {cond}"
    wet = any(w in cond for w in ("rain", "drizzle", "showers", "thunder"))
    hot = t >= (27 if U == "C" else 80)
    cold = t <= (5 if U == "C" else 41)
    if kind in ("rain", "umbrella"):
        if wet:
            s = rng.choice([f"Yes, it is raining in {c} right now: {cond}, {t}°{U}.",
                            f"Yes. The weather in {c} is {cond} at the moment, so take an umbrella. It is {t}°{U}."])
        else:
            s = rng.choice([f"No, it is not raining in {c} right now. It is {desc}.",
                            f"No rain in {c} at the moment: it is {desc}, so you should not need an umbrella."])
    elif kind == "snow":
        s = (f"Yes, it is snowing in {c}: {desc}." if "snow" in cond
             else f"No, there is no snow in {c} right now. It is {desc}.")
    elif kind == "sunny":
        s = (f"Yes, it is {cond} in {c} right now, {t}°{U}." if cond in ("sunny", "clear")
             else f"Not at the moment. It is {desc} in {c}.")
    elif kind == "windy":
        s = f"The wind in {c} is {wind} km/h right now, and it is {desc}."
    elif kind in ("hot", "cold", "warm"):
        feel = "hot" if hot else "cold" if cold else "mild"
        s = f"It is {t}°{U} in {c} right now, which is {feel}. The sky is {cond}."
    else:
        s = rng.choice([
            f"It is currently {desc} in {c}.",
            f"In {c} it is {cond} right now, with a temperature of {t}°{U} and {hum}% humidity.",
            f"The weather in {c}: {cond}, {t}°{U}, humidity {hum}%, wind {wind} km/h.",
            f"Right now {c} has {cond} skies and a temperature of {t}°{U}.",
            f"It's {t}°{U} in {c} at the moment, and the weather is {cond}.",
        ])
    return s


def _weather_result(rng, c, unit):
    tc = rng.randint(-15, 38)
    cond = rng.choice(CONDITIONS)
    if tc < 0 and "rain" in cond:
        cond = "snow"
    t = tc if unit == "celsius" else round(tc * 9 / 5 + 32)
    return {"location": c, "temperature": t, "unit": unit, "condition": cond,
            "humidity": rng.randint(20, 98), "wind_kph": rng.randint(0, 45)}


def _call(name, args):
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": args}}]}


def weather_user(rng, c, templates=WEATHER_TRAIN, unit_templates=WEATHER_UNIT_TRAIN,
                 p_unit=0.15, p_lower=0.1):
    if rng.random() < p_unit:
        tpl, unit = rng.choice(unit_templates)
    else:
        tpl, unit = rng.choice(templates), None
    text = tpl.format(c=c)
    if templates is WEATHER_TRAIN and rng.random() < 0.3:
        text = rng.choice(PREFIXES) + text + rng.choice(SUFFIXES)
    if rng.random() < p_lower:
        text, c = text.lower(), c.lower()
    return text, c, unit, _kind(tpl)


def weather_turns(rng, c, user_text=None, unit=None, kind="general"):
    args = {"location": c}
    if unit:
        args["unit"] = unit
    res = _weather_result(rng, c, unit or "celsius")
    msgs = [{"role": "user", "content": user_text}] if user_text else []
    msgs += [_call("get_weather", args),
             {"role": "tool", "content": json.dumps(res)},
             {"role": "assistant", "content": _weather_answer(rng, c, res, kind)}]
    return msgs


# ---------------------------------------------------------------- calculator / time

def _fmt(x):
    if abs(x - round(x)) < 1e-9:
        return str(int(round(x)))
    return f"{x:.4f}".rstrip("0").rstrip(".")


def calc_dialogue(rng):
    a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(2, 20)
    op = rng.choice(["+", "-", "*", "/", "mix", "pct"])
    if op == "mix":
        expr = f"({a} + {b}) * {c}"
        q = rng.choice([f"What is ({a} + {b}) times {c}?", f"Calculate ({a} + {b}) * {c}.",
                        f"Can you work out ({a} + {b}) * {c}?"])
        val = (a + b) * c
    elif op == "pct":
        expr = f"{b} / 100 * {a}"
        q = rng.choice([f"What is {b}% of {a}?", f"Calculate {b} percent of {a}."])
        val = b / 100 * a
    else:
        expr = f"{a} {op} {b}"
        word = {"+": "plus", "-": "minus", "*": "times", "/": "divided by"}[op]
        q = rng.choice([f"What is {a} {word} {b}?", f"Calculate {expr}", f"What's {expr}?",
                        f"How much is {a} {word} {b}?", f"{expr} = ?",
                        f"Can you compute {expr} for me?", f"what is {a} {word} {b}"])
        val = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]
    r = _fmt(val)
    ans = rng.choice([f"{expr} = {r}.", f"The answer is {r}.", f"{q.rstrip('?.')} is {r}."
                      if q.lower().startswith("what is") else f"The result is {r}."])
    return [{"role": "user", "content": q}, _call("calculator", {"expression": expr}),
            {"role": "tool", "content": json.dumps({"result": float(r) if "." in r else int(r)})},
            {"role": "assistant", "content": ans}]


def time_dialogue(rng, c):
    q = rng.choice([f"What time is it in {c}?", f"What's the time in {c} right now?",
                    f"Current time in {c}?", f"Tell me the local time in {c}."])
    hh, mm = rng.randint(0, 23), rng.randint(0, 59)
    res = {"location": c, "time": f"{hh:02d}:{mm:02d}"}
    return [{"role": "user", "content": q}, _call("get_time", {"location": c}),
            {"role": "tool", "content": json.dumps(res)},
            {"role": "assistant", "content": rng.choice([
                f"It is {hh:02d}:{mm:02d} in {c} right now.",
                f"The local time in {c} is {hh:02d}:{mm:02d}."])}]


# ---------------------------------------------------------------- small talk, facts, stories

SMALL_TALK = [
    (["Hello!", "Hi", "Hi there!", "Hey", "Good morning!", "hello"],
     ["Hello! How can I help you today?", "Hi! What can I do for you?",
      "Hello! What would you like to talk about?"]),
    (["How are you?", "How are you doing today?", "how are you"],
     ["I'm doing well, thank you for asking. How can I help you?",
      "I'm fine, thanks! What can I do for you today?"]),
    (["What is your name?", "Who are you?", "What are you?"],
     ["I am a small demo language model that runs on sluice. I can chat a little, tell short stories and call tools such as a weather service.",
      "I'm a tiny assistant model, trained to show how sluice runs a mixture-of-experts model. I can answer simple questions and call tools."]),
    (["What can you do?", "How can you help me?", "What are you good at?"],
     ["I can answer simple questions, tell short stories, and, when tools are available, look up the weather, the time or do arithmetic with a calculator.",
      "I can chat, write a short story, and use tools like a weather lookup or a calculator when they are offered."]),
    (["Thank you!", "Thanks!", "thanks", "Thank you very much.", "Great, thanks."],
     ["You're welcome!", "You're welcome. Is there anything else I can help with?",
      "Glad I could help!"]),
    (["Goodbye!", "Bye", "See you later.", "Good night!"],
     ["Goodbye! Have a nice day.", "Bye! Take care.", "Good night! Sleep well."]),
    (["Tell me a joke.", "Do you know a joke?", "Make me laugh."],
     ["Why did the scarecrow win an award? Because he was outstanding in his field.",
      "Why don't eggs tell jokes? They would crack each other up.",
      "What do you call a bear with no teeth? A gummy bear."]),
    (["Who wrote Pride and Prejudice?", "Who is the author of Pride and Prejudice?"],
     ["Pride and Prejudice was written by Jane Austen and published in 1813."]),
    (["Who wrote Emma?"], ["Emma is a novel by Jane Austen, published in 1815."]),
    (["Who was Jane Austen?", "Tell me about Jane Austen."],
     ["Jane Austen was an English novelist who lived from 1775 to 1817. She wrote Sense and Sensibility, Pride and Prejudice, Mansfield Park, Emma, Northanger Abbey and Persuasion."]),
    (["Who is Elizabeth Bennet?"],
     ["Elizabeth Bennet is the heroine of Jane Austen's novel Pride and Prejudice. She is clever and lively, and in the end she marries Mr. Darcy."]),
    (["Who is Mr. Darcy?"],
     ["Mr. Darcy is a rich and proud gentleman in Pride and Prejudice who falls in love with Elizabeth Bennet."]),
    (["What is the sun?", "What is the Sun made of?"],
     ["The Sun is the star at the centre of our solar system. It is a huge ball of hot gas, mostly hydrogen and helium."]),
    (["Why is the sky blue?"],
     ["The sky looks blue because air scatters blue sunlight much more than red light, so blue light reaches our eyes from every direction."]),
    (["How many days are in a week?"], ["There are seven days in a week."]),
    (["What are the days of the week?"],
     ["The days of the week are Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday."]),
    (["How many months are in a year?"], ["There are twelve months in a year."]),
    (["What are the four seasons?"], ["The four seasons are spring, summer, autumn and winter."]),
    (["What colour is grass?", "What color is grass?"], ["Grass is green."]),
    (["What is water made of?"],
     ["Water is made of molecules of two hydrogen atoms and one oxygen atom, H2O."]),
    (["What is the largest ocean?"], ["The Pacific Ocean is the largest ocean on Earth."]),
    (["What is the tallest mountain in the world?"],
     ["Mount Everest, in the Himalayas, is the tallest mountain in the world, at about 8,849 metres."]),
    (["How many continents are there?"],
     ["There are seven continents: Africa, Antarctica, Asia, Australia, Europe, North America and South America."]),
    (["What is a mixture of experts?", "What is a mixture-of-experts model?"],
     ["A mixture-of-experts model has many small feed-forward networks, the experts, and a router that sends each token to only a few of them. That makes the model large but cheap to run."]),
    (["What is sluice?"],
     ["Sluice is an engine that runs mixture-of-experts language models on the CPU, streaming the experts from disk when the model does not fit in memory."]),
    (["Can you help me?", "I need help."], ["Of course. What do you need help with?"]),
    (["I'm bored.", "I am bored."],
     ["How about a short story? Or ask me about the weather somewhere in the world.",
      "Maybe read a good book? Jane Austen's novels are a fine place to start."]),
    (["What is your favourite book?", "What's your favorite book?"],
     ["I like Pride and Prejudice by Jane Austen. It is witty and full of memorable characters."]),
    (["Do you like music?"],
     ["I can't hear music, but I know people love it. What kind of music do you like?"]),
    (["What is the capital of the moon?"], ["The Moon has no capital. Nobody lives there."]),
    (["Is it going to rain tomorrow?"],
     ["I don't know where you are. Tell me the city and I can check the weather if a weather tool is available."]),
]

ANIMALS = ["rabbit", "fox", "little bird", "cat", "dog", "mouse", "bear", "duck", "owl", "frog",
           "squirrel", "hedgehog", "horse", "lamb", "turtle", "deer"]
NAMES = ["Tom", "Lily", "Sam", "Anna", "Ben", "Mia", "Max", "Rose", "Leo", "Emma", "Jack", "Lucy"]
PLACES = ["a quiet forest", "a small village", "a green valley", "a farm by the river",
          "a big old house", "a garden full of flowers", "a little town by the sea",
          "the edge of a dark wood"]
WANTS = ["to find a friend", "to see the sea", "to climb the tallest hill", "to bake a cake",
         "to learn to swim", "to find a lost key", "to build a little boat", "to see the stars"]
PROBLEMS = ["a storm came and the wind blew hard", "the path was long and steep",
            "it got dark and cold", "a river was in the way", "the others laughed at the idea",
            "the rain would not stop"]
HELPERS = ["a kind old owl", "a clever fox", "a brave little mouse", "a friendly dog",
           "an old fisherman", "a wise grandmother"]
ENDINGS = ["From that day on, they were the best of friends.",
           "That night, everyone was happy, and they slept well.",
           "And they learned that it is good to ask for help.",
           "It was the best day of the whole year.",
           "And every summer after that, they went back to the same place."]


def _an(noun):
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def story(rng, animal=None):
    a = animal or rng.choice(ANIMALS)
    n = rng.choice(NAMES)
    p, w, pr, h, e = (rng.choice(PLACES), rng.choice(WANTS), rng.choice(PROBLEMS),
                      rng.choice(HELPERS), rng.choice(ENDINGS))
    s = [rng.choice(["Once upon a time", "Long ago", "One sunny morning", "Once upon a time"]) +
         f", there was {_an(a)} named {n} who lived in {p}.",
         f"{n} wanted very much {w}.",
         rng.choice([f"One day, {n} set off early in the morning.",
                     f"So one morning {n} said goodbye and started out."]),
         f"But soon {pr}, and {n} felt afraid.",
         f"Then {h} came by and asked what was wrong.",
         rng.choice([f"\"Do not worry,\" said the helper. \"We can do it together.\"",
                     f"{n} told the whole story, and the helper smiled."]),
         rng.choice([f"Together they kept going, step by step, until at last {n} was able {w}.",
                     f"With a little help, {n} found a way, and at last the wish came true."]),
         e]
    return " ".join(s)


def facts_qa(rng, facts):
    f = rng.choice(facts)
    k = rng.random()
    if k < 0.55:
        q = rng.choice([f"What is the capital of {f['country']}?", f"capital of {f['country']}?",
                        f"Which city is the capital of {f['country']}?"])
        a = rng.choice([f"The capital of {f['country']} is {f['capital']}.",
                        f"{f['capital']} is the capital of {f['country']}."])
    elif k < 0.75:
        q = f"{f['capital']} is the capital of which country?"
        a = f"{f['capital']} is the capital of {f['country']}."
    else:
        if not f["location"]:
            return facts_qa(rng, facts)
        q = rng.choice([f"Where is {f['country']}?", f"Where is {f['country']} located?"])
        a = f"{f['country']} is in {f['location'][0].lower() + f['location'][1:]}."
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def plain_turn(rng, facts):
    k = rng.random()
    if k < 0.45:
        qs, ans = rng.choice(SMALL_TALK)
        return [{"role": "user", "content": rng.choice(qs)},
                {"role": "assistant", "content": rng.choice(ans)}]
    if k < 0.8:
        return facts_qa(rng, facts)
    a = rng.choice(ANIMALS)
    q = rng.choice([f"Tell me a story about {_an(a)}.", "Tell me a story.", "Tell me a short story.",
                    f"Can you tell me a bedtime story about {_an(a)}?", "Once upon a time..."])
    return [{"role": "user", "content": q}, {"role": "assistant", "content": story(rng, a)}]


SYSTEMS = [None] * 6 + ["You are a helpful assistant.", "You are a friendly, concise assistant.",
                        "You are a helpful assistant. Use the tools when they help."]


def _tools(rng):
    r = rng.random()
    if r < 0.45:
        return [WEATHER_TOOL, CALCULATOR_TOOL]
    if r < 0.65:
        return [WEATHER_TOOL]
    if r < 0.8:
        return [CALCULATOR_TOOL, WEATHER_TOOL]
    return rng.sample([WEATHER_TOOL, CALCULATOR_TOOL, TIME_TOOL], 3)


def train_dialogue(rng, place, facts):
    """One training conversation: (messages, tools or None)."""
    system = rng.choice(SYSTEMS)
    msgs = [{"role": "system", "content": system}] if system else []
    k = rng.random()
    if k < 0.45:  # weather call
        tools = _tools(rng)
        c = place(rng)
        text, c2, unit, kind = weather_user(rng, c)
        msgs += weather_turns(rng, c2, text, unit, kind)
        if rng.random() < 0.2:  # follow-up
            c3 = place(rng)
            follow = rng.choice([f"And in {c3}?", f"What about {c3}?", f"How about {c3}?",
                                 f"And what is the weather in {c3}?"])
            msgs += weather_turns(rng, c3, follow)
        elif rng.random() < 0.15:
            msgs += [{"role": "user", "content": rng.choice(["Thanks!", "Thank you."])},
                     {"role": "assistant", "content": rng.choice(["You're welcome!",
                                                                  "Happy to help!"])}]
    elif k < 0.55:
        tools = _tools(rng)
        if not any(t["function"]["name"] == "calculator" for t in tools):
            tools = tools + [CALCULATOR_TOOL]
        msgs += calc_dialogue(rng)
    elif k < 0.59:
        tools = [WEATHER_TOOL, TIME_TOOL] if rng.random() < 0.5 else [TIME_TOOL, WEATHER_TOOL, CALCULATOR_TOOL]
        msgs += time_dialogue(rng, place(rng))
    elif k < 0.73:  # tools offered, not needed
        tools = _tools(rng)
        msgs += plain_turn(rng, facts)
        if rng.random() < 0.25:
            msgs += plain_turn(rng, facts)
    elif k < 0.76:  # weather asked without a weather tool
        tools = None if rng.random() < 0.6 else [CALCULATOR_TOOL]
        c = place(rng)
        text, c2, _, _ = weather_user(rng, c, p_unit=0)
        msgs += [{"role": "user", "content": text},
                 {"role": "assistant", "content": rng.choice([
                     f"I can't check live weather for {c2} because I don't have a weather tool here. A weather website or app will have the current conditions.",
                     f"Sorry, I don't have access to current weather data, so I can't tell you the weather in {c2} right now."])}]
    else:  # no tools
        tools = None
        msgs += plain_turn(rng, facts)
        while rng.random() < 0.3:
            msgs += plain_turn(rng, facts)
    return msgs, tools


def train_dialogues(seed, n, facts, words, eval_cities=EVAL_CITIES):
    """`words`: capitalised English words (from the training prose) for invented place names."""
    rng = random.Random(seed)
    banned = {c.lower() for c in eval_cities}
    cities = sorted({f["capital"] for f in facts} | set(TRAIN_CITIES_EXTRA))
    cities = [c for c in cities if c.lower() not in banned]
    words = [w for w in words if w.lower() not in banned]
    place = Places(cities, words, eval_cities)
    return [train_dialogue(rng, place, facts) for _ in range(n)], cities


EVAL_POOL = 43  # the eval's trained-phrasing half draws from the first 43 templates (fixed set)


def eval_weather(seed=1234):
    """40 held-out weather prompts: unseen cities, half of them with unseen phrasings."""
    rng = random.Random(seed)
    out = []
    for i, c in enumerate(EVAL_CITIES):
        unit = None
        if i % 10 == 3:
            tpl, unit = WEATHER_UNIT_EVAL[(i // 10) % 2]
        elif i % 2 == 0:
            tpl = WEATHER_EVAL[(i // 2) % len(WEATHER_EVAL)]
        else:
            tpl = rng.choice(WEATHER_TRAIN[:EVAL_POOL])
        text = tpl.format(c=c)
        if i % 13 == 5:
            text = text.lower()
        out.append({"id": i, "messages": [{"role": "user", "content": text}],
                    "expected": {"name": "get_weather", "location": c, "unit": unit},
                    "phrasing_held_out": tpl not in WEATHER_TRAIN})
    return out
