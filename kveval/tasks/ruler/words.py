"""Plain English words for the RULER-style families, written for kveval (RULER draws its words from the
``wonderwords`` package's noun, adjective and verb lists, which kveval does not depend on).

* needle keys of type ``words`` are ``adjective-noun`` pairs (as RULER's: ``"quiet-harbor"``);
* the common-words family draws its list from :data:`WORDS` (nouns, adjectives and verbs together), and from
  ``adjective-noun`` pairs when a length needs more distinct words than that (as RULER falls back to a larger
  list).

Lowercase letters only; :data:`WORDS` holds each word once (a few are both a noun and a verb).
"""

from __future__ import annotations

ADJECTIVES = tuple("""
able absent active acute agile alert ample ancient angry anxious aromatic ashamed awake bad bald basic bent bitter
blank bleak blind blunt bold bored brave brief bright brisk broad broken brown busy calm careful casual cheap cheerful
chilly civil clean clear clever close cloudy clumsy coarse cold common cool costly crazy crisp crooked cruel curious
curly damp dark dear decent deep dense dirty dizzy double dry dull dusty eager early easy elegant empty equal exact
faint fair false famous fancy fast fierce filthy fine firm flat fluffy fond foolish formal fragile free fresh friendly
frozen full funny gentle giant glad gloomy golden good graceful grand grateful greasy great greedy green grumpy guilty
handsome happy hard harsh hasty healthy heavy helpful hidden high hollow honest hot huge humble hungry icy idle ill
jolly juicy keen kind large late lazy lean light little lively lonely long loose loud lovely loyal lucky mad massive
mature meek mellow merry mild minor modern modest moist narrow nasty naughty neat nervous new nice noble noisy normal
odd old open orange pale patient plain pleasant plump polite poor portly precious pretty proud purple quick quiet
rapid rare raw ready real rich rigid ripe rough round royal rude rusty sad safe salty scarce second secret shaggy
shallow sharp shiny short shy silent silky silly simple sleek slim slow small smooth soft solid sour spare splendid
square stale steady steep sticky stiff still stormy strange strict strong sturdy subtle sudden sunny super sweet swift
tall tame tender tense thick thin thirsty tidy tight tiny tired tough tricky true ugly unique upset urban useful vague
valid vast vivid warm wary weak weary wet white whole wide wild wise witty wooden worried young zany zealous
""".split())

NOUNS = tuple("""
acorn actor adult airport album alley anchor angle animal ankle apple apron arch arena arrow artist atlas attic
autumn avenue badge bagel bakery balloon banana band banjo barn barrel basket battery beach beacon beard bedroom beetle
bell bench berry bicycle blanket blossom boat bonnet book boot bottle boulder bracelet branch bread breeze brick bridge
broom bubble bucket buffalo bunny butter button cabin cable cactus camel camera canal candle canoe canyon captain
carpet carrot castle cattle cellar chair chalk cherry chimney circus city cliff clock closet cloud coast cobweb coffee
comet compass cookie copper cottage cotton county crayon creek cricket crown cushion daisy desert diamond dinner
doctor dolphin donkey dragon drawer dream drum eagle easel elbow engine envelope fabric falcon farmer feather fence
ferry festival fiddle field finger flag flame flower flute forest fossil fountain fox frog garden garlic gate giraffe
glacier glove goat granite grape guitar hammer harbor harvest hat hedge helmet hill hive honey horizon horse hotel
island ivory jacket jaguar jar jelly jewel journal jungle kettle kitten kite ladder lake lamp lantern lemon lettuce
library lighthouse lion lizard lobster locket magnet mango maple market meadow melon mirror mitten monkey moon
mountain mouse muffin museum napkin necklace needle nest noodle notebook oak ocean office olive onion orchard otter
owl oyster paddle palace pancake panda parrot pasture peach peanut pebble pencil penguin pepper piano pickle pigeon
pillow pilot pine planet plum pocket pond potato pumpkin puppet puzzle quarry quilt rabbit radio raft rainbow raven
ribbon river robin rocket saddle sailor salad sandal satchel saucer scarf school scooter seal shadow shark shell
shovel silver singer skate sled slipper snail sparrow spider spoon squirrel stable stadium statue stone stove street
sugar suitcase summit swan sweater table teacup temple tent thimble thunder tiger timber toaster tomato tower tractor
train tulip tunnel turtle umbrella valley vase velvet village violin volcano wagon walnut walrus wardrobe whistle
willow window winter wizard wolf yacht yogurt zebra
""".split())

VERBS = tuple("""
accept admire advise agree allow answer appear arrange arrive attach avoid bake balance bathe battle beg behave
bless blink boast boil borrow bounce breathe brush bump calculate camp carve celebrate chase cheer chew chop clap
coach collect comb compare complain concentrate confess consider construct cough count crawl cross crush dance deliver
depend describe deserve destroy develop disagree discover dive divide double drag drain dress drift drop dust earn
educate embrace employ enjoy enter escape examine exist expand explain explode fasten fetch file fix flash float
flood flourish fold follow forgive frighten gather gaze glide glow grab grasp greet grin guard guess guide hammer
handle hang harm hatch heal hover hum hunt hurry ignore imagine impress improve include inform inject inspect invent
invite itch jog joke judge juggle kneel knit knock label land laugh launch learn lick limp listen load lock march
marry measure melt memorize mend milk mix moan mourn move nail nod obey observe obtain occur offer open order
organize pack paddle paint pat pause pedal peel perform permit pinch plant play plead plug polish pour pray preach
prefer prepare present preserve pretend print promise protect provide pull pump punch punish push question quit race
rain raise reach recall receive recognize record reduce reflect refuse regret reign rejoice relax release remain
remember remind repair repeat replace reply report rescue retire return rinse risk roast rob rub ruin rush sail scare
scatter scold scrape scratch scream search settle shave shelter shiver shop shrug sigh sign sip skip slap sneeze sniff
snore sparkle spell spill spray sprout squeak squeeze stamp stare steer step stir stitch stroll struggle stuff suck
suggest supply support suppose surprise surround suspect swallow sway tame taste tease telephone tempt test thank
thaw tickle tie tip tour trace trade train travel treat tremble trip trot trust tumble twist type unfold unite unlock
unpack untie vanish visit wade wail wait wander warn wash waste watch wave weigh welcome whirl whisper wiggle wink
wobble worry wrap wreck wrestle wriggle yawn yell zoom
""".split())


def _unique(*lists: tuple[str, ...]) -> tuple[str, ...]:
    """The words of ``lists`` in order, each once (a word that is both a noun and a verb counts once)."""
    seen: dict[str, None] = {}
    for words in lists:
        seen.update(dict.fromkeys(words))
    return tuple(seen)


WORDS = _unique(NOUNS, ADJECTIVES, VERBS)
"""Every distinct word of the three lists (the common-words family's vocabulary)."""

__all__ = ["ADJECTIVES", "NOUNS", "VERBS", "WORDS"]
