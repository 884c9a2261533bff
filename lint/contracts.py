"""qrl's own import-linter contract (``lint-imports`` loads it from the repository root).

An algorithm is three places that name it: its package ``qrl/algos/NAME/``, its actor
``qrl/actors/NAME.py`` and its learner ``qrl/learners/NAME.py``. No module of one algorithm
imports a module of another: they share only a family base (``qrl/algos/apex_family/``,
``qrl/actors/replay.py``...) and the generic layers. A new algorithm is found by its package,
so it is covered without a line here.
"""

from __future__ import annotations

from grimp import ImportGraph
from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


class AlgorithmIndependence(Contract):
    algorithms = fields.StringField()  # the package whose subpackages are algorithms
    places = fields.ListField(subfield=fields.StringField())  # packages of NAME modules
    families = fields.ListField(subfield=fields.StringField(), required=False)

    def _modules(self, graph: ImportGraph) -> dict[str, set[str]]:
        families = set(self.families or [])  # type: ignore[arg-type]
        out = {}
        for package in graph.find_children(str(self.algorithms)):
            name = package.rsplit(".", 1)[1]
            if name in families or not graph.find_children(package):
                continue  # a family base, or a module beside the packages (the registry)
            mods = {package} | graph.find_descendants(package)
            mods |= {f"{p}.{name}" for p in self.places if f"{p}.{name}" in graph.modules}  # type: ignore[union-attr]
            out[name] = mods
        return out

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        algos = self._modules(graph)
        owner = {m: name for name, mods in algos.items() for m in mods}
        broken = sorted(
            (importer, imported)
            for importer, name in owner.items()
            for imported in graph.find_modules_directly_imported_by(importer)
            if owner.get(imported, name) != name
        )
        return ContractCheck(kept=not broken, warnings=[], metadata={"broken": broken})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for importer, imported in check.metadata["broken"]:
            output.print_error(f"{importer} imports {imported}: another algorithm's module")
            output.new_line()
