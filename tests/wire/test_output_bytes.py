"""A pass's outputs routed to their owners as `output` messages written as bytes: the same
entries, in the same order, and byte for byte what msgspec makes of the Structs."""

from __future__ import annotations

import msgspec
import pytest

from engined.core import types as core
from engined.wire import control, convert
from engined.wire.output_bytes import MAX_LEADS, OutputWriter

DECODE = msgspec.msgpack.Decoder(control.DaemonMessage).decode
ENCODE = msgspec.msgpack.Encoder().encode


def same_name(request_id: str) -> str:
    return request_id


class Asked:
    """A `name_of` that records what it was asked."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def __call__(self, request_id: str) -> str:
        self.ids.append(request_id)
        return request_id


def route(
    outputs: list[core.RequestOutput],
    decodes: core.Decodes,
    owners: dict[str, bytes],
    rank: int = 0,
    writer: OutputWriter | None = None,
) -> tuple[dict[bytes, bytes], list[str]]:
    return (writer or OutputWriter(same_name)).route(outputs, decodes, owners, rank)


def entries(body: bytes) -> list[control.OutputEntry]:
    msg = DECODE(body)
    assert isinstance(msg, control.Output)
    return msg.outputs


def step(request_id: str, token: int) -> control.OutputEntry:
    return control.OutputEntry(
        request_id=request_id, token_ids=[token], finished=False, finish_reason=None
    )


def no_outputs(steps: int = 0) -> core.Decodes:
    return core.Decodes([f"s{i}" for i in range(steps)], list(range(steps)), [])


class TestRouting:
    def test_entries_per_owner_in_order_and_the_ends(self) -> None:
        outputs = [
            core.RequestOutput("a1", [1], None, 4),
            core.RequestOutput("b1", [2]),
            core.RequestOutput("gone", [3]),
            core.RequestOutput("a2", [], core.FinishReason.CANCELLED),
            core.RequestOutput("b2", [5], core.FinishReason.LENGTH),
        ]
        owners = {"a1": b"A", "a2": b"A", "b1": b"B", "b2": b"B"}
        messages, ended = route(outputs, core.Decodes([], [], [0] * len(outputs)), owners, 2)
        assert list(messages) == [b"A", b"B"]
        expected_a = [convert.to_output_entry(outputs[0]), convert.to_output_entry(outputs[3])]
        expected_b = [convert.to_output_entry(outputs[1]), convert.to_output_entry(outputs[4])]
        assert DECODE(messages[b"A"]) == control.Output(dp_rank=2, outputs=expected_a)
        assert DECODE(messages[b"B"]) == control.Output(dp_rank=2, outputs=expected_b)
        assert ended == ["a2", "b2"]

    def test_equal_identities_of_distinct_frames_share_one_message(self) -> None:
        # Every message's identity frame is a bytes object of its own.
        first, second = bytes(bytearray(b"C")), bytes(bytearray(b"C"))
        assert first == second and first is not second
        outputs = [core.RequestOutput("c1", [1]), core.RequestOutput("c2", [2])]
        messages, ended = route(outputs, core.Decodes([], [], [0, 0]), {"c1": first, "c2": second})
        assert list(messages) == [b"C"]
        assert entries(messages[b"C"]) == [convert.to_output_entry(o) for o in outputs]
        assert ended == []

    def test_nothing_owned_routes_nothing(self) -> None:
        routed = route(
            [core.RequestOutput("x", [], core.FinishReason.LENGTH)],
            core.Decodes(["y"], [1], [1]),
            {},
        )
        assert routed == ({}, [])

    def test_decode_steps_take_their_place_in_emission_order(self) -> None:
        # Emission order: a0, a1, b0, gone, b2, a3 (a1 and b2 are outputs, the rest steps).
        outputs = [
            core.RequestOutput("a1", [1], None, 4),
            core.RequestOutput("b2", [5], core.FinishReason.LENGTH),
        ]
        decodes = core.Decodes(["a0", "b0", "gone", "a3"], [10, 11, 12, 13], [1, 3])
        owners = {"a0": b"A", "a1": b"A", "a3": b"A", "b0": b"B", "b2": b"B"}
        messages, ended = route(outputs, decodes, owners)
        in_order = [convert.to_output_entry(o) for o in decodes.in_order(outputs)]
        assert [e.request_id for e in in_order] == ["a0", "a1", "b0", "gone", "b2", "a3"]
        assert entries(messages[b"A"]) == [in_order[0], in_order[1], in_order[5]]
        assert entries(messages[b"B"]) == [in_order[2], in_order[4]]
        assert entries(messages[b"A"])[0] == step("a0", 10)
        assert ended == ["b2"]

    def test_an_owner_s_entries_interleaved_with_another_s_stay_one_message(self) -> None:
        decodes = core.Decodes(["a0", "b0", "a1", "b1", "a2"], [1, 2, 3, 4, 5], [])
        owners = {"a0": b"A", "a1": b"A", "a2": b"A", "b0": b"B", "b1": b"B"}
        messages, _ = route([], decodes, owners)
        assert entries(messages[b"A"]) == [step("a0", 1), step("a1", 3), step("a2", 5)]
        assert entries(messages[b"B"]) == [step("b0", 2), step("b1", 4)]

    def test_steps_without_outputs(self) -> None:
        messages, _ = route([], no_outputs(2), {"s0": b"S", "s1": b"S"})
        assert entries(messages[b"S"]) == [step("s0", 0), step("s1", 1)]

    def test_the_outputs_must_come_with_their_places(self) -> None:
        with pytest.raises(AssertionError, match="one entry per output"):
            route([core.RequestOutput("o", [3])], core.Decodes([], [], []), {"o": b"O"})


class TestAliases:
    def test_entries_carry_the_name_the_owner_knows(self) -> None:
        names = {"r\x1f1": "r"}
        writer = OutputWriter(lambda core_id: names.get(core_id, core_id))
        outputs = [
            core.RequestOutput("r\x1f1", [7], None, 3),
            core.RequestOutput("r\x1f1", [9], core.FinishReason.LENGTH),
        ]
        decodes = core.Decodes(["r\x1f1", "q"], [8, 5], [0, 1])
        messages, ended = route(outputs, decodes, {"r\x1f1": b"A", "q": b"A"}, writer=writer)
        got = entries(messages[b"A"])
        assert [e.request_id for e in got] == ["r", "r", "r", "q"]
        assert got[1] == step("r", 8)
        assert got[2].finish_reason == "length" and got[2].token_ids == [9]
        # The core's name ends the request: the caller forgets the alias by it.
        assert ended == ["r\x1f1"]


class TestLeads:
    def test_a_request_s_lead_is_dropped_with_its_last_entry(self) -> None:
        asked = Asked()
        writer = OutputWriter(asked)
        owners = {"r": b"A"}
        for token in (1, 2):
            route([], core.Decodes(["r"], [token], []), owners, writer=writer)
        assert asked.ids == ["r"]
        last = core.RequestOutput("r", [3], core.FinishReason.LENGTH)
        route([last], core.Decodes([], [], [0]), owners, writer=writer)
        # A request id used again later (a client may reuse one) gets its lead anew.
        route([], core.Decodes(["r"], [4], []), owners, writer=writer)
        assert asked.ids == ["r", "r", "r"]

    def test_an_unowned_request_s_end_drops_its_lead_too(self) -> None:
        asked = Asked()
        writer = OutputWriter(asked)
        route([], core.Decodes(["r"], [1], []), {"r": b"A"}, writer=writer)
        gone = core.RequestOutput("r", [], core.FinishReason.CANCELLED)
        route([gone], core.Decodes([], [], [0]), {}, writer=writer)
        route([], core.Decodes(["r"], [1], []), {"r": b"A"}, writer=writer)
        assert asked.ids == ["r", "r"]

    def test_past_the_bound_the_leads_start_again(self) -> None:
        asked = Asked()
        writer = OutputWriter(asked)
        many = no_outputs(MAX_LEADS + 1)
        owners = {request_id: b"A" for request_id in many.request_ids}
        route([], many, owners, writer=writer)
        route([], core.Decodes(["s0"], [1], []), owners, writer=writer)
        assert len(asked.ids) == MAX_LEADS + 2 and asked.ids[-1] == "s0"
        route([], core.Decodes(["s0"], [1], []), owners, writer=writer)
        assert len(asked.ids) == MAX_LEADS + 2


TOKENS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1]
IDS = ["", "r", "x" * 31, "x" * 32, "y" * 255, "z" * 256, "z" * 65536, "é-ü-😀", "a\x1f7"]


class TestBytes:
    """Whole messages against msgspec's encoding of the Structs the daemon used to send."""

    @staticmethod
    def struct_message(
        outputs: list[core.RequestOutput], decodes: core.Decodes, rank: int
    ) -> bytes:
        in_order = [convert.to_output_entry(o) for o in decodes.in_order(outputs)]
        return ENCODE(control.Output(dp_rank=rank, outputs=in_order))

    @pytest.mark.parametrize("token", TOKENS)
    def test_tokens_of_every_width(self, token: int) -> None:
        decodes = core.Decodes(["r"], [token], [])
        messages, _ = route([], decodes, {"r": b"A"}, rank=3)
        assert messages[b"A"] == self.struct_message([], decodes, 3)

    @pytest.mark.parametrize("request_id", IDS)
    def test_ids_of_every_length_and_script(self, request_id: str) -> None:
        decodes = core.Decodes([request_id, request_id], [5, 300], [])
        messages, _ = route([], decodes, {request_id: b"A"})
        assert messages[b"A"] == self.struct_message([], decodes, 0)

    @pytest.mark.parametrize("count", [1, 15, 16, 65535, 65536])
    def test_array_heads_of_every_width(self, count: int) -> None:
        decodes = no_outputs(count)
        messages, _ = route([], decodes, dict.fromkeys(decodes.request_ids, b"A"))
        assert messages[b"A"] == self.struct_message([], decodes, 0)

    @pytest.mark.parametrize("rank", [0, 127, 128, 70000])
    def test_ranks(self, rank: int) -> None:
        decodes = core.Decodes(["r"], [1], [])
        messages, _ = route([], decodes, {"r": b"A"}, rank=rank)
        assert messages[b"A"] == self.struct_message([], decodes, rank)

    def test_every_kind_of_entry_among_steps(self) -> None:
        outputs = [
            core.RequestOutput("first", [1, 2], None, 16),
            core.RequestOutput("burst", [3, 4, 5]),
            core.RequestOutput("stopped", [6], core.FinishReason.STOP, stop_reason=6),
            core.RequestOutput("prefilled", [7], core.FinishReason.LENGTH, handoff_delay_ms=2.5),
            core.RequestOutput("rejected", [], core.FinishReason.REJECTED),
        ]
        decodes = core.Decodes(["s0", "s1", "s2", "s3"], [10, 200, 70000, 0], [0, 2, 2, 3, 4])
        owners = dict.fromkeys([o.request_id for o in outputs] + decodes.request_ids, b"A")
        messages, ended = route(outputs, decodes, owners, rank=1)
        assert messages[b"A"] == self.struct_message(outputs, decodes, 1)
        assert ended == ["stopped", "prefilled", "rejected"]


class TestWeightVersions:
    """Entries labelled with a weight version (`set_weight_version`): byte for byte the
    Structs with `weight_version` set, and a request's unlabelled lead is not reused."""

    @staticmethod
    def labelled(
        outputs: list[core.RequestOutput], decodes: core.Decodes, rank: int, version: str
    ) -> bytes:
        in_order = [convert.to_output_entry(o, None, version) for o in decodes.in_order(outputs)]
        return ENCODE(control.Output(dp_rank=rank, outputs=in_order))

    @pytest.mark.parametrize("version", ["v2", "", "ü" * 100, "x" * 256])
    def test_every_kind_of_entry_labelled(self, version: str) -> None:
        outputs = [
            core.RequestOutput("first", [1, 2], None, 16),
            core.RequestOutput("stopped", [6], core.FinishReason.STOP, stop_reason=6),
        ]
        decodes = core.Decodes(["s0", "s1", "s0"], [10, 70000, 3], [1, 2])
        owners = dict.fromkeys(["first", "stopped", "s0", "s1"], b"A")
        messages, _ = route_labelled(outputs, decodes, owners, 5, version)
        assert messages[b"A"] == self.labelled(outputs, decodes, 5, version)
        assert {e.weight_version for e in entries(messages[b"A"])} == {version}

    def test_a_request_switches_between_labelled_and_not(self) -> None:
        writer = OutputWriter(same_name)
        owners = {"r": b"A"}
        for version in (None, "v1", None, "v2"):
            decodes = core.Decodes(["r"], [7], [])
            messages, _ = writer.route([], decodes, owners, 0, version)
            assert entries(messages[b"A"]) == [
                msgspec.structs.replace(step("r", 7), weight_version=version)
            ]


def route_labelled(
    outputs: list[core.RequestOutput],
    decodes: core.Decodes,
    owners: dict[str, bytes],
    rank: int,
    version: str,
) -> tuple[dict[bytes, bytes], list[str]]:
    return OutputWriter(same_name).route(outputs, decodes, owners, rank, version)
