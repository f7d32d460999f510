"""Regenerate the sample inputs in jobs/data/ (deterministic, no network):

    .venv/bin/python jobs/data/make_sample_data.py

prompts.jsonl / prompts.parquet: ~300 single-turn prompts (id, prompt, category), mostly short,
some a few hundred words; chat.jsonl: ~20 conversations in a `messages` column.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 20261130

FACTUAL = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What is the capital of Canada?",
    "What is the capital of Australia?",
    "What is the capital of Brazil?",
    "What is the capital of Egypt?",
    "What is the capital of Kenya?",
    "What is the capital of Norway?",
    "What is the largest planet in our solar system?",
    "What is the smallest planet in our solar system?",
    "How many planets are in the solar system?",
    "What is the boiling point of water at sea level in Celsius?",
    "What is the freezing point of water in Fahrenheit?",
    "Who wrote the play Romeo and Juliet?",
    "Who painted the Mona Lisa?",
    "Who was the first person to walk on the Moon?",
    "What gas do plants absorb from the air?",
    "What is the chemical symbol for gold?",
    "What is the chemical symbol for iron?",
    "What is H2O more commonly called?",
    "How many continents are there?",
    "What is the longest river in Africa?",
    "What is the tallest mountain on Earth?",
    "Which ocean is the largest?",
    "How many days are there in a leap year?",
    "How many legs does a spider have?",
    "How many sides does a hexagon have?",
    "What is the hardest natural substance?",
    "What language is spoken in Brazil?",
    "What currency is used in Japan?",
    "Which planet is known as the Red Planet?",
    "What is the speed of light, approximately?",
    "What organ pumps blood through the human body?",
    "How many bones are in the adult human body?",
    "What is the largest mammal?",
    "What is the main ingredient in guacamole?",
    "In which country are the pyramids of Giza?",
    "What is photosynthesis?",
    "What does DNA stand for?",
    "What is the square root of 81?",
    "Which element has the atomic number 1?",
    "What is the largest desert in the world?",
    "Who developed the theory of general relativity?",
    "What instrument has 88 keys?",
    "How many minutes are in a day?",
    "What is the opposite of 'ancient'?",
    "What color do you get when you mix blue and yellow?",
    "Which animal is known as the king of the jungle?",
    "What is the largest country by area?",
    "What is the main language spoken in Mexico?",
    "What is the closest star to Earth?",
    "What do bees make?",
    "What is the capital city of Italy?",
    "What is the plural of 'mouse'?",
    "Which month has the fewest days?",
    "What is a baby cat called?",
    "What is the primary source of energy for Earth?",
    "How many hours are in a week?",
    "What is the largest organ of the human body?",
    "Which metal is liquid at room temperature?",
]

INSTRUCTIONS = [
    "Give me three tips for sleeping better.",
    "List five fruits that are high in vitamin C.",
    "Suggest a name for a friendly robot.",
    "Write a short thank-you note to a teacher.",
    "Describe a sunset in one sentence.",
    "Give two reasons why exercise is good for you.",
    "Write a grocery list for a simple pasta dinner.",
    "Suggest three fun activities for a rainy day.",
    "Name four animals that live in the ocean.",
    "Write a one-sentence slogan for a bakery.",
    "Explain how to boil an egg, step by step.",
    "Give me a simple recipe for a fruit salad.",
    "List the days of the week.",
    "Write a polite email asking to reschedule a meeting.",
    "Suggest a title for a story about a lost dog.",
    "Give three ideas for a birthday present for a friend who likes books.",
    "Describe the taste of a lemon.",
    "Write a short motivational message for a student before an exam.",
    "List three ways to save water at home.",
    "Give me a packing list for a weekend camping trip.",
    "Write a two-line poem about the sea.",
    "Summarize the plot of Cinderella in three sentences.",
    "Give three tips for learning a new language.",
    "Write a short product description for a reusable water bottle.",
    "Name three primary colors.",
    "Give me a tongue twister.",
    "Write a friendly greeting for a new neighbor.",
    "Suggest a healthy breakfast.",
    "List four things you need to plant a tree.",
    "Write a short apology for arriving late.",
]

TEMPLATES = {
    "explain": (
        "Explain {} in simple terms.",
        ["gravity", "the water cycle", "how a rainbow forms", "what a computer does", "why the sky is blue",
         "how vaccines work", "what inflation is", "how plants grow", "what electricity is", "how a bicycle works",
         "what a volcano is", "how the heart works", "what the internet is", "why we have seasons",
         "how magnets work", "what recycling is"],
    ),
    "explain_child": (
        "How would you explain {} to a five-year-old?",
        ["the Moon", "clouds", "the ocean tides", "dinosaurs", "music", "money", "sleep", "the weather"],
    ),
    "creative": (
        "Write a haiku about {}.",
        ["autumn leaves", "the morning coffee", "a quiet library", "snow", "the city at night", "a cat",
         "the first day of spring", "a thunderstorm", "the moon", "an old bridge"],
    ),
    "story": (
        "Write a short story, no more than five sentences, about {}.",
        ["a robot who learns to paint", "a lost umbrella", "a dragon who is afraid of fire", "a talking tree",
         "two friends building a boat", "a mouse in a bakery", "a kite that flies to the moon",
         "a girl who finds a map"],
    ),
    "translation": (
        "Translate into {1}: \"{0}\"",
        [("Good morning", "French"), ("Thank you very much", "Spanish"), ("Where is the train station?", "German"),
         ("I like to read books", "Italian"), ("The weather is nice today", "French"), ("How are you?", "Spanish"),
         ("See you tomorrow", "Portuguese"), ("What time is it?", "German"), ("I am hungry", "French"),
         ("Happy birthday", "Spanish"), ("The cat is sleeping", "Italian"), ("Please open the window", "German")],
    ),
    "math": (
        "{}",
        ["What is 12 plus 30?", "What is 7 times 8?", "What is 100 divided by 4?", "What is 15% of 200?",
         "If I have 3 apples and buy 5 more, how many apples do I have?", "What is 2 to the power of 10?",
         "Is 17 a prime number?", "What is the sum of the angles in a triangle?",
         "A train travels 60 km in one hour. How far does it travel in 3 hours?", "What is half of 250?",
         "Round 3.14159 to two decimal places.", "What is 9 squared?",
         "If a pizza has 8 slices and I eat 3, how many are left?", "What is 1000 minus 357?",
         "Convert 2 hours into minutes.", "What is the next number in the sequence 2, 4, 8, 16?"],
    ),
    "coding": (
        "{}",
        ["Write a Python function that returns the sum of a list of numbers.",
         "Write a Python function that checks whether a string is a palindrome.",
         "What does the len() function do in Python?", "Explain what a for loop is.",
         "Write a Python one-liner that reverses a string.", "What is the difference between a list and a tuple in Python?",
         "Write a SQL query that selects all rows from a table named users.", "What is a variable in programming?",
         "Write a Python function that returns the largest number in a list.", "What does HTML stand for?",
         "Write a Python function that counts the vowels in a word.", "What is a bug in software?",
         "Write a JavaScript function that adds two numbers.", "Explain what recursion is in one paragraph.",
         "Write a Python loop that prints the numbers from 1 to 5.", "What is JSON?"],
    ),
    "rewrite": (
        "Rewrite this sentence to sound more formal: \"{}\"",
        ["Hey, can you send me the report?", "We gotta finish this by Friday.", "Thanks a lot for the help!",
         "I can't make it to the meeting.", "This idea is super cool.", "Let's grab lunch sometime.",
         "The printer is broken again.", "I'll get back to you soon."],
    ),
    "compare": (
        "What is the difference between {} and {}?",
        [("weather", "climate"), ("a virus", "bacteria"), ("a lake", "a sea"), ("speed", "velocity"),
         ("a simile", "a metaphor"), ("an alligator", "a crocodile"), ("baking soda", "baking powder"),
         ("a star", "a planet")],
    ),
    "define": (
        "What does the word '{}' mean?",
        ["generous", "fragile", "curious", "harvest", "orbit", "ancient", "brave", "journey", "echo", "puzzle",
         "glacier", "recipe"],
    ),
    "list": (
        "Name three {}.",
        ["countries in South America", "musical instruments", "types of clouds", "vegetables that grow underground",
         "famous bridges", "board games", "birds that cannot fly", "planets with rings", "kinds of trees",
         "sports played with a ball"],
    ),
    "advice": (
        "How can I {}?",
        ["become a better listener", "keep my houseplants alive", "stay focused while studying",
         "make new friends in a new city", "save money on groceries", "start running as a beginner",
         "organize my desk", "remember people's names", "write a good cover letter", "reduce screen time",
         "prepare for a long flight", "learn to cook"],
    ),
    "grammar": (
        "Correct the grammar in this sentence: \"{}\"",
        ["She don't like apples.", "Me and him went to the park.", "There is many books on the table.",
         "I has finished my homework.", "They was late for school.", "He go to work by bus every day.",
         "We was happy to see you.", "The dog wagged it's tail."],
    ),
    "fact_more": (
        "{}",
        ["Who invented the telephone?", "What is the largest island in the world?", "What is the capital of Spain?",
         "How many players are on a soccer team?", "What is the fastest land animal?", "What year did World War II end?",
         "What is the main gas in the air we breathe?", "Which planet has the most moons?",
         "What is the capital of Germany?", "What do caterpillars turn into?", "How many strings does a violin have?",
         "What is the coldest continent?", "What is the currency of the United Kingdom?",
         "Who wrote 'The Odyssey'?", "What is the longest bone in the human body?", "How many teeth does an adult human have?",
         "What is the capital of India?", "What is the largest lake in Africa?", "Where do penguins live?",
         "What is the main ingredient of bread?"],
    ),
    "classify": (
        "Is the following review positive or negative? \"{}\"",
        ["The food was delicious and the staff were friendly.", "I waited an hour and my order was wrong.",
         "Great value for money, I would buy it again.", "The battery died after two days.",
         "The movie was boring and far too long.", "Lovely hotel with a beautiful view of the sea."],
    ),
}

PASSAGES = {
    "honeybees": """Honeybees live in colonies that can hold tens of thousands of individuals, yet the colony behaves almost like a single organism. At its centre is the queen, the only fertile female, who may lay more than a thousand eggs a day during the height of summer. The vast majority of the colony are workers, sterile females whose jobs change as they age. Young workers clean cells and feed larvae; middle-aged workers build wax comb, process nectar and guard the entrance; the oldest workers fly out to forage. Male bees, called drones, do not collect food and exist mainly to mate with queens from other colonies. Foragers share the location of good flowers through the famous waggle dance, a figure-of-eight movement whose angle and duration tell their sisters the direction and distance of the food. Nectar brought back to the hive is passed from bee to bee, mixed with enzymes and fanned with wings until enough water evaporates to turn it into honey, which is then sealed under wax as a store for winter. In cold weather the bees cluster tightly together and shiver their flight muscles to keep the core of the cluster warm. Beyond making honey, bees pollinate a large share of the crops people eat, from apples and almonds to cucumbers, which is why declines in bee populations caused by disease, pesticides and the loss of wild flowers worry farmers and scientists alike.""",
    "printing_press": """Before the middle of the fifteenth century, books in Europe were copied by hand, usually by scribes working in monasteries. A single Bible could take a scribe more than a year to finish, so books were rare, expensive and owned mostly by churches, universities and the very rich. Around 1450, Johannes Gutenberg, a goldsmith from Mainz, combined several existing ideas into a practical printing system. He cast individual letters in a metal alloy that melted easily and hardened quickly, so that thousands of identical pieces of type could be produced. He developed an oil-based ink that stuck to metal, and he adapted the screw press, already used for making wine and olive oil, to press paper evenly against the inked type. The famous Gutenberg Bible, finished around 1455, showed that printed books could be as beautiful as handwritten ones. Within fifty years, printing shops had spread to more than two hundred cities, and millions of books had been produced. Cheaper books helped more people learn to read, allowed scholars in different countries to work from identical texts, and made it much harder for authorities to control which ideas spread. Historians often link the printing press to the Reformation, the Scientific Revolution and the growth of newspapers, although they continue to debate how quickly and how deeply these changes reached ordinary people.""",
    "volcanoes": """A volcano is an opening in the Earth's crust through which molten rock, gas and ash escape from below the surface. Deep underground, high temperatures and changes in pressure melt rock into magma. Because magma is lighter than the solid rock around it, it slowly rises and can collect in chambers a few kilometres beneath the surface. When the pressure of the magma and its dissolved gases becomes greater than the strength of the rock above, an eruption begins. Most volcanoes form along the edges of tectonic plates. Where one plate slides beneath another, water carried down with the sinking plate lowers the melting point of the rock above it and creates sticky, gas-rich magma, which tends to produce explosive eruptions like those of Mount St. Helens. Where plates pull apart, as along the Mid-Atlantic Ridge, runny magma wells up more gently. Some volcanoes, such as those of Hawaii, sit far from any plate boundary above hot spots, where unusually hot material rises from deep in the mantle. Eruptions can be destructive, burying towns under ash or lava and affecting the weather around the world for a year or more, but volcanic soil is also very fertile, and many communities have farmed the slopes of volcanoes for thousands of years. Scientists monitor earthquakes, ground swelling and gas emissions to warn people when an eruption may be near.""",
    "water_cycle": """The water cycle describes how water moves continuously between the oceans, the air and the land. Energy from the Sun heats water in oceans, lakes and rivers, and some of it evaporates, turning from liquid into invisible water vapour. Plants also release water vapour through tiny pores in their leaves, a process called transpiration. As warm, moist air rises, it cools, and the vapour condenses around tiny particles of dust or salt to form the droplets that make up clouds. When the droplets collide and grow heavy enough, they fall as precipitation: rain, snow, sleet or hail, depending on the temperature. Some of this water runs off the surface into streams and rivers and eventually returns to the sea. Some soaks into the ground, refilling underground layers of rock and soil called aquifers, which supply wells and springs. In cold regions water can be stored for a very long time as snow and glacier ice before it melts. The same water has been moving through this cycle for billions of years, which means the water in a glass today may once have fallen as rain on a dinosaur. Changes in temperature affect every step of the cycle, so a warmer climate can bring both heavier rainstorms in some places and longer droughts in others.""",
    "library": """The town of Millbrook reopened its public library on Saturday after an eighteen-month renovation that nearly doubled the size of the building. Hundreds of residents queued before the doors opened at nine o'clock, and the head librarian, Ana Ruiz, cut a ribbon made from the pages of damaged old books. The original building, built in 1962, had a leaking roof, poor heating and no space for the growing number of children's programmes. The new design adds a glass reading room overlooking the river, a workshop with sewing machines and 3D printers, six quiet study rooms that can be booked online, and a garden where story time will be held in the summer. The project cost 4.2 million dollars, most of it raised through a local bond approved by voters three years ago, with the rest coming from donations and a state grant for energy efficiency. Solar panels on the roof are expected to cover about a third of the building's electricity. Not everyone was pleased: some residents argued during planning meetings that the money should have gone to road repairs, and the temporary library in a former shoe shop was criticised for its short opening hours. On opening day, however, the mood was cheerful. Children's books were the most borrowed items, and the library issued more than three hundred new cards, a record for a single day.""",
    "bicycle": """The bicycle took almost a century to reach the form we know today. In 1817 the German inventor Karl Drais built the 'running machine', a wooden frame with two wheels and no pedals, which riders pushed along with their feet. In the 1860s, French makers attached pedals directly to the front wheel, creating a machine nicknamed the 'boneshaker' because of its iron tyres and rough ride on cobbled streets. To go faster with each turn of the pedals, designers made the front wheel larger and larger, producing the high-wheeler or penny-farthing, which was fast but dangerous, since a sudden stop could throw the rider over the handlebars. The breakthrough came in the 1880s with the 'safety bicycle', which had two wheels of equal size and a chain that drove the rear wheel, letting gears provide speed without a giant wheel. Soon afterwards, air-filled rubber tyres made riding far more comfortable. The safety bicycle became hugely popular in the 1890s. It gave ordinary people, and especially women, a new kind of freedom to travel on their own, influenced fashion by encouraging looser clothing, and pushed governments to build smoother roads. Many techniques developed for bicycle factories, such as ball bearings and steel tubing, were later used by the first car and aeroplane makers.""",
}

CATEGORY_OF = {"explain_child": "explain", "fact_more": "factual"}  # template key -> category

LONG_TASKS = [
    ("summarize", "Summarize the following passage in two sentences.\n\n{}"),
    ("key_facts", "Read the text below and list three key facts from it.\n\n{}"),
    ("title", "Suggest a short, informative title for this article.\n\n{}"),
]

LONG_OPEN = [
    "I am planning a small vegetable garden in my backyard. The area gets about six hours of sun a day, "
    "the soil is a bit sandy, and I live somewhere with hot, dry summers and mild winters. I have never "
    "grown vegetables before, I can spend about two hours a week on it, and I would like to grow things "
    "my family will actually eat, such as tomatoes, lettuce and beans. What should I plant first, how should "
    "I prepare the soil, and what common mistakes should I avoid as a beginner?",
    "Our team of five people keeps missing deadlines. Tasks are assigned in a weekly meeting, but people "
    "often forget what they agreed to, two colleagues work part-time on different days, and we use email, "
    "a chat app and a shared spreadsheet without clear rules about which one to use for what. Nobody is "
    "officially the project lead. Suggest a simple plan, in a few steps, to help the team keep track of "
    "work and finish on time, without buying new software.",
    "My grandmother is turning ninety next month. She loves gardening, old films and her five grandchildren, "
    "but she does not like big crowds or loud music, and she gets tired in the evening. The family wants to "
    "celebrate in a way that feels special to her. Suggest a plan for the day, including food, an activity "
    "and a small gift idea.",
]

CONVERSATIONS = [  # single-turn prompts that quote a short dialogue for the model to continue
    "Continue this conversation with one reply from the shopkeeper.\nCustomer: Hello, do you sell umbrellas?\n"
    "Shopkeeper: Yes, we have several kinds.\nCustomer: Which one is best for strong wind?",
    "Here is a chat between a student and a tutor.\nStudent: I don't understand fractions.\n"
    "Tutor: Let's start with pizza. If you cut a pizza into 4 equal slices and eat 1, what fraction did you eat?\n"
    "Student: One quarter?\nWrite the tutor's next message.",
    "Two friends are planning a trip.\nAlex: Should we go to the mountains or the beach?\n"
    "Sam: I'd like somewhere quiet.\nAlex: Then maybe the mountains. What should we pack?\nWrite Sam's answer.",
    "A customer writes to support: 'My order arrived but one of the two mugs is broken.' "
    "The agent answered: 'I'm sorry to hear that! Could you send a photo?' The customer sent a photo. "
    "Write the agent's next reply.",
    "Continue the dialogue.\nTeacher: Who can tell me what the largest ocean is?\nPupil: The Atlantic?\nTeacher:",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
     {"role": "user", "content": "Why do leaves change color in autumn?"}],
    [{"role": "user", "content": "Can you recommend a book for a long train ride?"},
     {"role": "assistant", "content": "Sure! Do you prefer fiction or non-fiction?"},
     {"role": "user", "content": "Fiction, something adventurous."}],
    [{"role": "system", "content": "You are a friendly cooking assistant."},
     {"role": "user", "content": "I have eggs, spinach and cheese. What can I make?"}],
    [{"role": "user", "content": "What is 6 times 7?"},
     {"role": "assistant", "content": "6 times 7 is 42."},
     {"role": "user", "content": "And what is that divided by 2?"}],
    [{"role": "system", "content": "You are a helpful travel guide."},
     {"role": "user", "content": "I have one day in Rome. What should I see?"}],
    [{"role": "user", "content": "Translate 'good night' into Spanish."},
     {"role": "assistant", "content": "'Good night' in Spanish is 'buenas noches'."},
     {"role": "user", "content": "How about in Italian?"}],
    [{"role": "user", "content": "Give me a word that rhymes with 'cat'."}],
    [{"role": "system", "content": "You explain science to children."},
     {"role": "user", "content": "Why is the ocean salty?"}],
    [{"role": "user", "content": "I feel nervous about my job interview tomorrow."},
     {"role": "assistant", "content": "That's completely normal. What kind of job is it?"},
     {"role": "user", "content": "It's for a library assistant position."},
     {"role": "assistant", "content": "That sounds lovely! Have you thought about why you want to work there?"},
     {"role": "user", "content": "Not really. What should I say?"}],
    [{"role": "user", "content": "Write a haiku about rain."}],
    [{"role": "system", "content": "Answer with a single word."},
     {"role": "user", "content": "What color is the sky on a clear day?"}],
    [{"role": "user", "content": "What is a good name for a goldfish?"},
     {"role": "assistant", "content": "How about 'Bubbles'?"},
     {"role": "user", "content": "Something more unusual, please."}],
    [{"role": "user", "content": "Explain what a noun is."}],
    [{"role": "system", "content": "You are a patient math tutor."},
     {"role": "user", "content": "How do I find the area of a rectangle?"},
     {"role": "assistant", "content": "Multiply its length by its width."},
     {"role": "user", "content": "So a 3 by 4 rectangle has what area?"}],
    [{"role": "user", "content": "List three animals that can fly."}],
    [{"role": "user", "content": "Summarize in one sentence: " + PASSAGES["water_cycle"]}],
    [{"role": "system", "content": "You are a helpful assistant that writes short emails."},
     {"role": "user", "content": "Write an email inviting my team to a picnic on Friday."}],
    [{"role": "user", "content": "Who wrote Pride and Prejudice?"},
     {"role": "assistant", "content": "Jane Austen wrote Pride and Prejudice."},
     {"role": "user", "content": "When was it published?"}],
    [{"role": "user", "content": "Tell me a fun fact about octopuses."}],
]


def prompt_rows() -> list[dict]:
    rows: list[tuple[str, str]] = [("factual", q) for q in FACTUAL]
    rows += [("instruction", q) for q in INSTRUCTIONS]
    for key, (template, fills) in TEMPLATES.items():
        category = CATEGORY_OF.get(key, key)
        for fill in fills:
            rows.append((category, template.format(*(fill if isinstance(fill, tuple) else (fill,)))))
    for name, text in PASSAGES.items():
        for task, template in LONG_TASKS:
            rows.append(("long_" + task, template.format(text)))
        rows.append(("long_question", f"{text}\n\nBased on the passage above, what is the most surprising fact in it, and why?"))
    rows += [("long_advice", text) for text in LONG_OPEN]
    rows += [("conversation", text) for text in CONVERSATIONS]
    first, rest = rows[0], rows[1:]  # the capital-of-France question stays row 0 for the demo
    random.Random(SEED).shuffle(rest)
    return [{"id": f"p{i:04d}", "prompt": prompt, "category": category}
            for i, (category, prompt) in enumerate([first, *rest])]


def chat_rows() -> list[dict]:
    return [{"id": f"c{i:04d}", "messages": messages} for i, messages in enumerate(CHATS)]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


# jobs/caption.toml's images: small drawings (the Pillow primitives, seeded), each with a caption prompt
PICTURES = [
    ("sunset.png", "Describe this picture in one sentence."),
    ("shapes.png", "How many shapes are in this picture, and what colours are they?"),
    ("chart.png", "What does this bar chart show?"),
]


def draw_pictures() -> list[dict]:
    from PIL import Image, ImageDraw

    (HERE / "images").mkdir(exist_ok=True)
    sunset = Image.new("RGB", (320, 200), (250, 170, 90))
    d = ImageDraw.Draw(sunset)
    for y in range(120):
        d.line([(0, y), (320, y)], fill=(250, 170 - y, 90 + y))
    d.ellipse([120, 80, 200, 160], fill=(255, 220, 60))
    d.rectangle([0, 140, 320, 200], fill=(30, 60, 120))
    shapes = Image.new("RGB", (240, 240), "white")
    d = ImageDraw.Draw(shapes)
    d.ellipse([20, 20, 100, 100], fill="red")
    d.rectangle([130, 30, 210, 110], fill="blue")
    d.polygon([(60, 210), (120, 130), (180, 210)], fill="green")
    chart = Image.new("RGB", (300, 200), "white")
    d = ImageDraw.Draw(chart)
    d.line([(30, 180), (290, 180)], fill="black", width=2)
    d.line([(30, 10), (30, 180)], fill="black", width=2)
    for i, h in enumerate((60, 120, 90, 150)):
        d.rectangle([50 + 60 * i, 180 - h, 90 + 60 * i, 180], fill=(70, 130, 180))
    for (name, _), img in zip(PICTURES, (sunset, shapes, chart)):
        img.save(HERE / "images" / name, optimize=True)
    return [{"id": f"p{i}", "image": f"images/{name}", "prompt": prompt} for i, (name, prompt) in enumerate(PICTURES)]


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(HERE / "captions.jsonl", draw_pictures())

    prompts = prompt_rows()
    write_jsonl(HERE / "prompts.jsonl", prompts)
    write_jsonl(HERE / "chat.jsonl", chat_rows())
    pq.write_table(pa.Table.from_pylist(prompts), HERE / "prompts.parquet", row_group_size=64)
    words = [len(r["prompt"].split()) for r in prompts]
    print(f"{len(prompts)} prompts ({min(words)}-{max(words)} words), {len(CHATS)} chats -> {HERE}")


if __name__ == "__main__":
    main()
