"""The proof behind ``fusednorm.convert``'s second folding rule: an activation module called in
its parent's own ``forward`` directly on the outputs of norm modules, and on nothing else.

diffusers' blocks call their activation from ``forward``, e.g. HunyuanVideo's resnet block::

    hidden_states = self.norm1(hidden_states)
    hidden_states = self.nonlinearity(hidden_states)
    hidden_states = self.conv1(hidden_states)
    hidden_states = self.norm2(hidden_states)
    hidden_states = self.nonlinearity(hidden_states)

Folding the activation into the norms (and replacing it with ``nn.Identity``) changes nothing
when, on every path ``forward`` can take:

* every call of the activation is ``self.act(self.norm(...))``, or a statement
  ``v = self.act(v)`` whose preceding statement (on every path into it) is
  ``v = self.norm(...)`` binding the same name ``v``, or is reached from such a statement
  through view statements ``v = v.permute(...).flatten(...)`` alone: the activation only ever
  sees a norm's output (viewed), and the norm's output, whose only reference ``v`` the
  activation's statement replaces, reaches nothing else;
* every call of each of those norms is the argument of such an activation call or such a
  statement ``v = self.norm(...)`` followed by ``v = self.act(v)``, directly or after view
  statements, with the same activation everywhere;
* nothing else in the class names them (no other method, no ``getattr(self, "act")``, no ``self``
  handed elsewhere), and the function run is the one whose source is read (the same names,
  variables and constants: a file edited after import is not trusted).

A view statement rebinds ``v`` to a chain of ``permute``, ``transpose``, ``movedim``,
``flatten``, ``unflatten``, ``view``, ``reshape``, ``squeeze`` or ``unsqueeze`` calls on ``v``
whose arguments are shapes and dimensions (constants, names, tuples, arithmetic, attributes and
subscripts of other names, ``v.shape``; no calls, no other use of ``v``): an elementwise
activation gives the same values before such a view as after it. EasyAnimate's resnet blocks
normalize frames this way::

    hidden_states = hidden_states.permute(0, 2, 1, 3, 4).flatten(0, 1)
    hidden_states = self.norm1(hidden_states)
    hidden_states = hidden_states.unflatten(0, (batch_size, -1)).permute(0, 2, 1, 3, 4)
    hidden_states = self.nonlinearity(hidden_states)

``view`` with a keyword, or with one argument that is not a constant or a tuple (either may be a
dtype: a reinterpretation, not a view of the values), does not count.

Branches that cannot run are left out: an ``if`` on the module's configuration, an instance
attribute holding None, a bool, an int or a str, or a child module slot compared with None, is
evaluated as the module is at conversion (diffusers' ``ResnetBlock2D`` chooses its
``time_embedding_norm`` branch, and calls its activation on ``temb`` only with a
``time_emb_proj``). ``training`` is never taken as known. A fold that relied on such an attribute
installs a forward pre-hook (:class:`FoldAssumptions`) raising ``RuntimeError`` if it changes.

Anything the proof does not cover (a loop or ``with`` between the two statements, the first
statement of a block, a decorated forward, unreadable source) is simply not folded.
"""

import ast
import functools
import inspect
import textwrap
import types
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, List, Optional, Set, Tuple

from torch import nn

__all__ = ["ForwardFold", "FoldAssumptions", "forward_folds"]

# (attribute, expected): expected is the attribute's value (None, a bool, an int or a str), or,
# for a child module slot, _MODULE / None (whether the slot holds a module).
Fact = Tuple[str, object]


class _ModuleSlot:
    """A child module slot's fact: it holds a module (which one does not matter)."""

    def __repr__(self) -> str:
        return "a module"

    def __reduce__(self):  # one instance, kept one by pickling and deepcopy
        return "_MODULE"


_MODULE = _ModuleSlot()
_UNKNOWN = object()
_PLAIN = (type(None), bool, int, str)
# Names whose presence in a forward (or another method) means children may be reached other than
# as `self.name`: by name, through the module's dicts, or by nn.Module's walks over its children.
_DYNAMIC = frozenset({"getattr", "setattr", "delattr", "vars", "locals", "globals", "eval", "exec", "super",
                      "__dict__", "_modules", "__getattr__", "__getattribute__", "children", "named_children",
                      "modules", "named_modules", "get_submodule", "apply", "_apply"})


@dataclass(frozen=True)
class ForwardFold:
    """Fold the child activation ``activation`` into the child norms ``norms``; ``facts`` are the
    configuration attributes the proof assumed."""

    activation: str
    norms: Tuple[str, ...]
    facts: Tuple[Fact, ...]


class FoldAssumptions:
    """A forward pre-hook checking that the attributes a fold's proof took as known still hold."""

    def __init__(self, facts: Iterable[Fact], folds: str):
        self.facts = tuple(sorted(set(facts), key=repr))
        self.folds = folds

    def __call__(self, module: nn.Module, args) -> None:
        for name, expected in self.facts:
            current = _current(module, name)
            if expected is _MODULE:
                holds = isinstance(current, nn.Module)
            else:
                holds = type(current) is type(expected) and current == expected
            if not holds:
                raise RuntimeError(
                    f"fusednorm.convert folded {self.folds} of this {type(module).__name__} assuming its "
                    f"attribute {name!r} is {expected!r}, but it is now {current!r}: convert an unconverted "
                    f"copy of the model again after changing it")


def _current(module: nn.Module, name: str) -> object:
    if name in module._modules:
        return module._modules[name]
    return module.__dict__.get(name, _UNKNOWN)


# -- the forward's source ------------------------------------------------------------------------


def _function_def(fn: types.FunctionType) -> Optional[ast.FunctionDef]:
    """fn's definition, parsed from its source, or None where that source may not be what runs
    (no source, a decorator, names, variables or constants differing from the source's)."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    func = tree.body[0]
    if func.decorator_list or func.name != fn.__name__ or hasattr(fn, "__wrapped__"):
        return None
    # The file may have changed since it was imported: the source's code must use the same names,
    # variables and constants as the function's. (Not the same bytecode: the compiler of the
    # installed .pyc may differ in details, e.g. a method call's instructions.)
    code = compile(tree, "<fusednorm>", "exec")
    compiled = next((c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == fn.__name__), None)
    if compiled is None or _signature(compiled) != _signature(fn.__code__):
        return None
    return func


def _signature(code: types.CodeType) -> tuple:
    consts = sorted(repr(c) for c in code.co_consts if not isinstance(c, types.CodeType))
    return code.co_names, code.co_varnames, code.co_freevars, tuple(consts)


def _class_mentions(cls: type, forward: types.FunctionType, names: Set[str]) -> Optional[Set[str]]:
    """Which of `names` the class's other methods and attributes (through its bases but nn.Module)
    read as an attribute or hold as a string; None where a class's source cannot be read or
    another method reaches children by name or walks them (`_DYNAMIC`). Assignments
    (``self.act = nn.SiLU()`` in ``__init__``) do not count."""
    found: Set[str] = set()
    for base in cls.__mro__:
        if base in (nn.Module, object):
            continue
        mentioned = _mentions(base, forward)
        if mentioned is None:
            return None
        found |= mentioned & names
    return found


@functools.lru_cache(maxsize=None)
def _mentions(base: type, forward: types.FunctionType) -> Optional[FrozenSet[str]]:
    """The attribute names read and the strings held in base's class body, but in `forward`'s
    definition; None as for _class_mentions."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(base)))
    except (OSError, TypeError, SyntaxError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.ClassDef):
        return None
    found: Set[str] = set()
    for item in tree.body[0].body:
        if isinstance(item, ast.FunctionDef) and item.name == forward.__name__ \
                and base.__dict__.get(item.name) is forward:
            continue  # the forward itself: the proof reads it
        in_init = isinstance(item, ast.FunctionDef) and item.name == "__init__"
        for sub in ast.walk(item):
            if isinstance(sub, ast.Attribute):
                if not isinstance(sub.ctx, ast.Store):
                    found.add(sub.attr)
                if sub.attr in _DYNAMIC and not in_init:
                    return None
            elif isinstance(sub, ast.Name):
                if sub.id in _DYNAMIC and not in_init:
                    return None
            elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                found.add(sub.value)
    return frozenset(found)


# -- conditions on the configuration -------------------------------------------------------------


class _Conditions:
    """Evaluates `if` tests on the module's configuration: (value or _UNKNOWN, facts used)."""

    def __init__(self, module: nn.Module, self_name: str):
        self.module = module
        self.self_name = self_name

    def attribute(self, node: ast.expr):
        """(value, fact) of `self.name`, or None where it is not a configuration attribute."""
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == self.self_name) or node.attr == "training":
            return None
        name = node.attr
        if name in self.module._modules:
            child = self.module._modules[name]
            return child, (name, None if child is None else _MODULE)
        if name in self.module.__dict__ and type(self.module.__dict__[name]) in _PLAIN \
                and not isinstance(getattr(type(self.module), name, None), property):
            value = self.module.__dict__[name]
            return value, (name, value)
        return None

    def truth(self, node: ast.expr) -> Tuple[object, FrozenSet[Fact]]:
        """The test's truth value (True, False or _UNKNOWN) and the facts it rests on."""
        if isinstance(node, ast.Constant):
            return bool(node.value), frozenset()
        attr = self.attribute(node)
        if attr is not None:
            value, fact = attr
            if type(value) in _PLAIN:  # a module's truth may be its length (ModuleList)
                return bool(value), frozenset({fact})
            return _UNKNOWN, frozenset()
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            value, facts = self.truth(node.operand)
            return (_UNKNOWN, frozenset()) if value is _UNKNOWN else (not value, facts)
        if isinstance(node, ast.BoolOp):
            decisive = isinstance(node.op, ast.Or)  # the operand value that decides the whole
            facts: Set[Fact] = set()
            unknown = False
            for operand in node.values:
                value, used = self.truth(operand)
                if value is _UNKNOWN:
                    unknown = True
                elif value == decisive:
                    return decisive, frozenset(used)
                else:
                    facts |= used
            return (_UNKNOWN, frozenset()) if unknown else (not decisive, frozenset(facts))
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            op, left, right = node.ops[0], node.left, node.comparators[0]
            if isinstance(op, (ast.Is, ast.IsNot)) and isinstance(right, ast.Constant) and right.value is None:
                attr = self.attribute(left)
                if attr is not None:
                    value, fact = attr
                    return (value is None) == isinstance(op, ast.Is), frozenset({fact})
            if isinstance(op, (ast.Eq, ast.NotEq)):
                sides = []
                facts = set()
                for side in (left, right):
                    attr = self.attribute(side)
                    if isinstance(side, ast.Constant) and type(side.value) in _PLAIN:
                        sides.append(side.value)
                    elif attr is not None and type(attr[0]) in _PLAIN:
                        sides.append(attr[0])
                        facts.add(attr[1])
                    else:
                        return _UNKNOWN, frozenset()
                return (sides[0] == sides[1]) == isinstance(op, ast.Eq), frozenset(facts)
        return _UNKNOWN, frozenset()


# -- the proof -----------------------------------------------------------------------------------


@dataclass
class _Place:
    """A statement's place: its list, index, and the chain of compound statements around it."""

    body: List[ast.stmt]
    index: int
    parents: Tuple[Tuple[ast.stmt, List[ast.stmt], int], ...]  # (compound, its list, its index)
    live: bool
    dead_facts: FrozenSet[Fact]  # the facts that made it dead, where it is


def _call_of(node: ast.expr, self_name: str, names: Set[str]) -> Optional[str]:
    """The child name of `self.name(...)`, or None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
            and node.func.value.id == self_name and node.func.attr in names:
        return node.func.attr
    return None


def _assigned_call(stmt: ast.stmt, self_name: str, names: Set[str]) -> Optional[Tuple[str, str, ast.Call]]:
    """(target name, child name, call) of `v = self.child(...)`, or None."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        child = _call_of(stmt.value, self_name, names)
        if child is not None:
            return stmt.targets[0].id, child, stmt.value
    return None


def _rebinding_call(stmt: ast.stmt, self_name: str, names: Set[str]) -> Optional[Tuple[str, str, ast.Call]]:
    """(v, child name, call) of `v = self.child(v)` (one positional argument), or None."""
    found = _assigned_call(stmt, self_name, names)
    if found is None:
        return None
    call = found[2]
    if len(call.args) == 1 and not call.keywords and isinstance(call.args[0], ast.Name) and call.args[0].id == found[0]:
        return found
    return None


# Methods returning the same elements in another shape or order (a view, or reshape's copy):
# an elementwise activation commutes with them (the module docstring's view statements).
_VIEWS = frozenset({"permute", "transpose", "movedim", "flatten", "unflatten", "view", "reshape", "squeeze",
                    "unsqueeze"})


def _shape_argument(node: ast.expr, v: str) -> bool:
    """Whether `node` can only be a shape or a dimension of a view call on `v` without effects:
    built of constants, names but `v`, `v.shape`, tuples, lists, arithmetic, attributes and
    subscripts."""
    if isinstance(node, ast.Constant):
        return node.value is None or type(node.value) is int
    if isinstance(node, ast.Name):
        return node.id != v
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(_shape_argument(e, v) for e in node.elts)
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.USub, ast.UAdd)) and _shape_argument(node.operand, v)
    if isinstance(node, ast.BinOp):
        return _shape_argument(node.left, v) and _shape_argument(node.right, v)
    if isinstance(node, ast.Attribute):
        if node.attr in ("shape", "ndim") and isinstance(node.value, ast.Name):
            return True  # v's own shape too
        return _shape_argument(node.value, v)
    if isinstance(node, ast.Slice):
        return all(part is None or _shape_argument(part, v) for part in (node.lower, node.upper, node.step))
    if isinstance(node, ast.Subscript):
        index = node.slice.value if type(node.slice).__name__ == "Index" else node.slice  # Python 3.8's Index
        return _shape_argument(node.value, v) and _shape_argument(index, v)
    return False


def _view_statement(stmt: ast.stmt, v: str) -> bool:
    """Whether `stmt` is `v = v.view_method(...)...` (the module docstring's view statements)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == v):
        return False
    node = stmt.value
    if not isinstance(node, ast.Call):
        return False
    while isinstance(node, ast.Call):
        method = node.func
        if not (isinstance(method, ast.Attribute) and method.attr in _VIEWS):
            return False
        arguments = list(node.args) + [k.value for k in node.keywords]
        if any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args):
            return False  # **kwargs, *args: not known to be shapes
        if not all(_shape_argument(a, v) for a in arguments):
            return False
        if method.attr == "view" and (node.keywords or len(node.args) == 1 and not isinstance(
                node.args[0], (ast.Constant, ast.Tuple, ast.List, ast.UnaryOp))):
            return False  # maybe a dtype: x.view(torch.float16) reinterprets the values
        node = method.value
    return isinstance(node, ast.Name) and node.id == v


@functools.lru_cache(maxsize=None)
def _provable_forward(fn: types.FunctionType) -> Optional[Tuple[ast.FunctionDef, str]]:
    """fn's definition and its `self` name where the proof can read it: its source is what runs
    (_function_def), `self` appears only as `self.attribute`, and nothing reaches attributes by
    name (_DYNAMIC); else None. The same for every instance of a class: cached per function."""
    func = _function_def(fn)
    if func is None or not func.args.args:
        return None
    self_name = func.args.args[0].arg
    for node in ast.walk(func):
        if isinstance(node, ast.Name) and node.id in _DYNAMIC:
            return None
        if isinstance(node, ast.Attribute) and node.attr in _DYNAMIC:
            return None
    receivers = {id(n.value) for n in ast.walk(func) if isinstance(n, ast.Attribute)}
    if any(isinstance(n, ast.Name) and n.id == self_name and id(n) not in receivers for n in ast.walk(func)
           if n is not func):
        return None
    return func, self_name


def forward_folds(module: nn.Module, norms: Set[str], activations: Set[str]) -> List[ForwardFold]:
    """The folds of child activations into child norms that the module's ``forward`` proves exact
    (the module docstring's rules). ``norms`` and ``activations`` are the candidate child names
    (the caller checked the modules themselves: registered once, no hooks, supported)."""
    fn = getattr(type(module), "forward", None)
    if not isinstance(fn, types.FunctionType) or not norms or not activations:
        return []
    checked = _provable_forward(fn)
    if checked is None:
        return []
    func, self_name = checked
    elsewhere = _class_mentions(type(module), fn, set(norms) | set(activations))
    if elsewhere is None:
        return []
    return _Proof(func, self_name, _Conditions(module, self_name), set(norms), set(activations)).folds(elsewhere)


class _Proof:
    """The flow of one forward: where each statement stands and whether it can run, where each
    candidate child is named, and which of those places are the pairs the rules allow."""

    def __init__(self, func: ast.FunctionDef, self_name: str, conditions: _Conditions, norms: Set[str],
                 activations: Set[str]):
        self.self_name = self_name
        self.conditions = conditions
        self.norms = norms
        self.activations = activations
        self.places: Dict[int, _Place] = {}  # id(statement) -> its place
        self.occurrences: Dict[str, List[Tuple[ast.AST, ast.stmt]]] = {n: [] for n in norms | activations}
        self.parent_of = {id(child): node for node in ast.walk(func) for child in ast.iter_child_nodes(node)}
        self._visit(func.body, (), True, frozenset())

    def _visit(self, body: List[ast.stmt], parents, live: bool, dead_facts: FrozenSet[Fact]) -> None:
        """Records the places of `body`'s statements and the occurrences in them; a branch an `if`
        on the configuration rules out is dead, with the facts that ruled it out."""
        for index, stmt in enumerate(body):
            self.places[id(stmt)] = _Place(body, index, parents, live, dead_facts)
            inner = parents + ((stmt, body, index),)
            if isinstance(stmt, ast.If):
                value, facts = self.conditions.truth(stmt.test)
                self._scan(stmt.test, stmt)
                self._visit(stmt.body, inner, live and value is not False,
                            dead_facts | (facts if value is False else frozenset()))
                self._visit(stmt.orelse, inner, live and value is not True,
                            dead_facts | (facts if value is True else frozenset()))
            elif isinstance(stmt, (ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try)):
                for field, value in ast.iter_fields(stmt):
                    if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                        self._visit(value, inner, live, dead_facts)
                    elif field == "handlers":
                        for handler in value:
                            if handler.type is not None:
                                self._scan(handler.type, stmt)
                            self._visit(handler.body, inner, live, dead_facts)
                    elif isinstance(value, (ast.expr, list)):
                        self._scan(value, stmt)
            else:
                self._scan(stmt, stmt)  # nested functions and classes included: occurrences there are "other"

    def _scan(self, node, stmt: ast.stmt) -> None:
        for top in node if isinstance(node, list) else [node]:
            for sub in ast.walk(top):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                        and sub.value.id == self.self_name and sub.attr in self.occurrences:
                    self.occurrences[sub.attr].append((sub, stmt))

    def _exits(self, stmt: ast.stmt, facts: Set[Fact]) -> Optional[List[ast.stmt]]:
        """The statements a path falling through `stmt` ends with (adding to `facts` those of the
        branches ruled out); None where not known."""
        if isinstance(stmt, (ast.Raise, ast.Return)):
            return []
        if isinstance(stmt, ast.If):
            value, used = self.conditions.truth(stmt.test)
            out: List[ast.stmt] = []
            for branch, taken in ((stmt.body, value is not False), (stmt.orelse, value is not True)):
                if not taken:
                    facts |= used
                    continue
                if not branch:
                    return None  # falls through from the test
                last = self._exits(branch[-1], facts)
                if last is None:
                    return None
                out += last
            return out
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try,
                             ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or type(stmt).__name__ == "Match":
            return None
        return [stmt]

    def _successor(self, stmt: ast.stmt) -> Optional[ast.stmt]:
        """The statement run next after `stmt` when the path leaves only through `if`s."""
        place = self.places[id(stmt)]
        body, index, parents = place.body, place.index, place.parents
        while index + 1 == len(body):
            if not parents or not isinstance(parents[-1][0], ast.If):
                return None
            _, body, index = parents[-1]
            parents = parents[:-1]
        return body[index + 1]

    def _nested_partner(self, node: ast.AST, name: str) -> Optional[str]:
        """The other child of `self.act(self.norm(...))`, where `node` is either callee; else None."""
        call = self.parent_of.get(id(node))
        if not (isinstance(call, ast.Call) and call.func is node):
            return None
        if name in self.norms:
            outer = self.parent_of.get(id(call))
            if isinstance(outer, ast.Call) and len(outer.args) == 1 and outer.args[0] is call and not outer.keywords:
                return _call_of(outer, self.self_name, self.activations)
            return None
        if len(call.args) == 1 and not call.keywords:
            return _call_of(call.args[0], self.self_name, self.norms)
        return None

    def _norm_partner(self, node: ast.AST, stmt: ast.stmt) -> Optional[str]:
        """The activation of `v = self.norm(...)` followed by `v = self.act(v)`, directly or
        after view statements of `v`."""
        norm_call = _assigned_call(stmt, self.self_name, self.norms)
        if norm_call is None or norm_call[2].func is not node:
            return None
        follower = self._successor(stmt)
        while follower is not None and _view_statement(follower, norm_call[0]):
            follower = self._successor(follower)
        act_call = None if follower is None else _rebinding_call(follower, self.self_name, self.activations)
        return act_call[1] if act_call is not None and act_call[0] == norm_call[0] else None

    def _act_partners(self, node: ast.AST, stmt: ast.stmt, facts: Set[Fact]) -> Optional[Set[str]]:
        """The norms of the statements `v = self.norm(...)` that every path into `v = self.act(v)`
        leaves last, but for view statements of `v`; None where the occurrence is not such a
        statement or a path leaves another."""
        act_call = _rebinding_call(stmt, self.self_name, self.activations)
        if act_call is None or act_call[2].func is not node:
            return None
        return self._norms_before(stmt, act_call[0], facts)

    def _norms_before(self, stmt: ast.stmt, v: str, facts: Set[Fact]) -> Optional[Set[str]]:
        """The norms of the statements `v = self.norm(...)` that every path into `stmt` leaves
        last, through view statements of `v`; None where a path leaves another statement."""
        place = self.places[id(stmt)]
        if place.index == 0:
            return None
        before = self._exits(place.body[place.index - 1], facts)
        if before is None:
            return None
        partners: Set[str] = set()
        for prior in before:
            if _view_statement(prior, v):
                norms = self._norms_before(prior, v, facts)
                if norms is None:
                    return None
                partners |= norms
                continue
            norm_call = _assigned_call(prior, self.self_name, self.norms)
            if norm_call is None or norm_call[0] != v:
                return None
            partners.add(norm_call[1])
        return partners

    def folds(self, bad: Set[str]) -> List[ForwardFold]:
        """The folds, given the children already ruled out (`bad`: named elsewhere in the class)."""
        bad = set(bad)
        facts_of: Dict[str, Set[Fact]] = {name: set() for name in self.occurrences}
        partners: Dict[str, Set[str]] = {name: set() for name in self.occurrences}  # norm <-> activation
        for name, found in self.occurrences.items():
            for node, stmt in found:
                place = self.places[id(stmt)]
                if not place.live:
                    facts_of[name] |= place.dead_facts
                    continue
                partner = self._nested_partner(node, name)  # self.act(self.norm(...)): exact anywhere
                if partner is not None:
                    partners[name].add(partner)
                    continue
                if name in self.norms:
                    partner = self._norm_partner(node, stmt)
                    if partner is None:
                        bad.add(name)
                    else:
                        partners[name].add(partner)
                else:
                    norms = self._act_partners(node, stmt, facts_of[name])
                    if norms is None:
                        bad.add(name)
                    else:
                        partners[name] |= norms
        # A norm followed by two activations fails, and so does whatever is paired with a child
        # that failed; repeat until nothing more fails.
        bad |= {n for n in self.norms if len(partners[n]) > 1}
        while True:
            failing = {n for n in self.occurrences if n not in bad and partners[n] & bad}
            if not failing:
                break
            bad |= failing
        folds = []
        for act in sorted(self.activations - bad):
            members = sorted(n for n in self.norms - bad if partners[n] == {act})
            if not members:
                continue  # never called where it can run
            facts = set(facts_of[act]).union(*(facts_of[n] for n in members))
            folds.append(ForwardFold(act, tuple(members), tuple(sorted(facts, key=repr))))
        return folds
