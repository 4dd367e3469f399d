-- Wireshark dissector for the ncina wire protocol, version 1 (docs/protocol.md; docs/wireshark.md
-- says how to install and use it).
--
-- It decodes every datagram kind: a worker's chunk (nc8 codes or a server-mode blob), a result
-- (nc8 codes, int or int32 sums, or a blob), a notice (its rank bitmap), a hello and a handshake answer
-- (the job descriptor), and the authentication tag of a keyed job. Field names follow the scapy
-- layer (ncina.proto.layers) and ncina.proto.descriptor under the prefix "ncina.". A datagram
-- that an aggregator would drop before looking at its job gets expert info named after the drop
-- counter (truncated, bad_version, bad_format, bad_count, bad_length; bad_flags for a hello with
-- RESULT) and the generated field ncina.drop with that name. With the job's key in the "Job key"
-- preference, tags are verified (keyed BLAKE2b, as ncina.proto.tag computes them).
--
-- Registered on UDP port 47000 (a preference), and for "Decode As..." on any UDP port.
-- Written for Wireshark 4.x (Lua 5.2 to 5.4), without a bit library: the byte fields take
-- integer arithmetic, the tag's 64-bit words Wireshark's UInt64.

local PORT = 47000
local HEADER_SIZE = 16
local TAG_SIZE = 8
local NOTICE_SIZE = 8 -- the bitmap after a notice's header
local DESCRIPTOR_SIZE = 17 -- the job descriptor after a job datagram's header
local VERSION = 1

local FLAG_RESULT = 0x01
local FLAG_RETX = 0x02
local FLAG_POOL = 0x04
local GENERATION_MASK = 0x78
local FLAG_TAG = 0x80

local FORMAT_NC8, FORMAT_INT, FORMAT_BLOB, FORMAT_JOB, FORMAT_INT32 = 0, 1, 2, 3, 4
local FORMATS = { [0] = "nc8", [1] = "int", [2] = "blob", [3] = "job", [4] = "int32" }
local ELEMENT_SIZE = { [FORMAT_NC8] = 1, [FORMAT_INT] = 8, [FORMAT_INT32] = 4 }
local STATUS = { [0] = "ok (the job's descriptor)", [1] = "no such job",
                 [2] = "not authentic" }
local MODES = { [0] = "ina (nc8 results)", [1] = "ina (int results)", [2] = "server",
                [4] = "ina (int32 results)" }
-- What a job's members send (docs/protocol.md, "Hierarchical aggregation").
local UPLINKS = { [0] = "the mode's (nc8 codes; blobs in server mode)",
                  [1] = "int partial sums (a spine's leaves)" }
-- The nc8 results' rounding word (ncina.proto.nc8.ROUNDING_NAMES).
local ROUNDINGS = { [0] = "splitmix64 (revision 0)", [1] = "crc32 (revision 1)" }
-- The compressors' method tags (ncina.proto.compressors: each class's `tag`, the first byte of
-- a blob).
local METHODS = { [1] = "nc", [2] = "natdither", [3] = "qsgd", [4] = "terngrad", [5] = "topk",
                  [6] = "randk", [7] = "signsgd", [8] = "onebit", [9] = "fft", [10] = "3lc" }

local ncina = Proto("ncina", "ncina in-network aggregation")

local f = {
    version = ProtoField.uint8("ncina.version", "Version", base.DEC),
    flags = ProtoField.uint8("ncina.flags", "Flags", base.HEX),
    flag_result = ProtoField.bool("ncina.flags.result", "RESULT (from the aggregator)", 8, nil,
                                  FLAG_RESULT),
    flag_retx = ProtoField.bool("ncina.flags.retx", "RETX (retransmission)", 8, nil, FLAG_RETX),
    flag_pool = ProtoField.uint8("ncina.flags.pool", "POOL (pool version)", base.DEC, nil,
                                 FLAG_POOL),
    flag_generation = ProtoField.uint8("ncina.flags.generation", "Generation", base.DEC, nil,
                                       GENERATION_MASK),
    flag_tag = ProtoField.bool("ncina.flags.tag", "TAG (ends in an authentication tag)", 8, nil,
                               FLAG_TAG),
    format = ProtoField.uint8("ncina.format", "Format", base.DEC, FORMATS),
    emin = ProtoField.int8("ncina.emin", "e_min (code 1 is 2^e_min)", base.DEC),
    job = ProtoField.uint16("ncina.job", "Job", base.DEC),
    rank = ProtoField.uint16("ncina.rank", "Rank", base.DEC),
    slot = ProtoField.uint16("ncina.slot", "Slot", base.DEC),
    count = ProtoField.uint16("ncina.count", "Count (elements)", base.DEC),
    offset = ProtoField.uint32("ncina.offset", "Offset (the chunk's identity)", base.DEC),
    nonce = ProtoField.uint32("ncina.nonce", "Incarnation nonce (a hello's offset)", base.HEX),
    kind = ProtoField.string("ncina.kind", "Kind"),
    drop = ProtoField.string("ncina.drop", "Drop reason"),
    payload = ProtoField.bytes("ncina.payload", "Payload"),
    code = ProtoField.uint8("ncina.code", "NC8 code", base.HEX),
    code_sign = ProtoField.uint8("ncina.code.sign", "Sign", base.DEC, nil, 0x80),
    code_exponent = ProtoField.uint8("ncina.code.exponent", "Exponent code c", base.DEC, nil,
                                     0x7f),
    sum = ProtoField.int64("ncina.sum", "Sum (units of 2^e_min)", base.DEC),
    value = ProtoField.double("ncina.value", "Value"),
    blob = ProtoField.bytes("ncina.blob", "Blob (compressor payload)"),
    blob_method = ProtoField.uint8("ncina.blob.method", "Method", base.DEC, METHODS),
    blob_count = ProtoField.uint32("ncina.blob.count", "Elements", base.DEC),
    bitmap = ProtoField.uint64("ncina.bitmap", "Contributors' bitmap", base.HEX),
    held = ProtoField.uint8("ncina.bitmap.rank", "Contribution held from rank", base.DEC),
    status = ProtoField.uint8("ncina.descriptor.status", "Status", base.DEC, STATUS),
    mode = ProtoField.uint8("ncina.descriptor.mode", "Mode", base.DEC, MODES),
    e_max = ProtoField.int8("ncina.descriptor.e_max", "e_max", base.DEC),
    e_min = ProtoField.int8("ncina.descriptor.e_min", "e_min", base.DEC),
    workers = ProtoField.uint16("ncina.descriptor.workers", "Workers", base.DEC),
    pool_size = ProtoField.uint16("ncina.descriptor.pool_size", "Pool size (slots)", base.DEC),
    k = ProtoField.uint16("ncina.descriptor.k", "K (elements per chunk)", base.DEC),
    keyed = ProtoField.uint8("ncina.descriptor.keyed", "Keyed", base.DEC),
    uplink = ProtoField.uint8("ncina.descriptor.uplink", "Uplink", base.DEC, UPLINKS),
    compressor = ProtoField.uint32("ncina.descriptor.compressor", "Compressor hash", base.HEX),
    rounding = ProtoField.uint8("ncina.descriptor.rounding", "NC8 rounding", base.DEC, ROUNDINGS),
    tag = ProtoField.bytes("ncina.tag", "Authentication tag"),
    tag_valid = ProtoField.bool("ncina.tag.valid", "Tag verifies with the key preference"),
    segments = ProtoField.uint16("ncina.segments", "Datagrams in this UDP GSO packet", base.DEC),
}
ncina.fields = {}
for _, field in pairs(f) do
    table.insert(ncina.fields, field)
end

-- Expert info: one per drop reason an aggregator finds without the job (docs/protocol.md,
-- "Order of checks" 1-5 and the handshake's checks), plus notes on what is worth seeing.
local e = {
    truncated = ProtoExpert.new("ncina.truncated", "Truncated: shorter than the 16-byte header",
                                expert.group.MALFORMED, expert.severity.ERROR),
    bad_version = ProtoExpert.new("ncina.bad_version", "Unknown protocol version",
                                  expert.group.MALFORMED, expert.severity.ERROR),
    bad_format = ProtoExpert.new("ncina.bad_format", "Unknown payload format",
                                 expert.group.MALFORMED, expert.severity.ERROR),
    bad_count = ProtoExpert.new("ncina.bad_count", "Bad element count",
                                expert.group.MALFORMED, expert.severity.ERROR),
    bad_length = ProtoExpert.new("ncina.bad_length", "Payload length does not match the count",
                                 expert.group.MALFORMED, expert.severity.ERROR),
    bad_flags = ProtoExpert.new("ncina.bad_flags", "Flags a sender of this kind never sets",
                                expert.group.MALFORMED, expert.severity.ERROR),
    bad_tag = ProtoExpert.new("ncina.bad_tag", "The tag does not verify with the key preference",
                              expert.group.CHECKSUM, expert.severity.ERROR),
    retx = ProtoExpert.new("ncina.retx", "Retransmission", expert.group.SEQUENCE,
                           expert.severity.NOTE),
    notice = ProtoExpert.new("ncina.notice", "Notice: the slot is incomplete or the packet stale",
                             expert.group.SEQUENCE, expert.severity.NOTE),
    gso = ProtoExpert.new("ncina.gso", "Several datagrams of one UDP GSO send",
                          expert.group.REASSEMBLE, expert.severity.NOTE),
    refused = ProtoExpert.new("ncina.refused", "Handshake refused", expert.group.RESPONSE_CODE,
                              expert.severity.WARN),
}
ncina.experts = {}
for _, expert_field in pairs(e) do
    table.insert(ncina.experts, expert_field)
end

ncina.prefs.port = Pref.uint("UDP port", PORT, "The aggregators' UDP port (ncina.proto.PORT)")
ncina.prefs.key = Pref.string("Job key (hex)", "",
                              "A keyed job's shared secret, 16 to 64 bytes as hex digits (the "
                              .. "--key-file's text): tags are then verified")
ncina.prefs.gso = Pref.bool("Split UDP GSO packets", true,
                            "Decode a UDP payload made of equal-length datagrams back to back "
                            .. "(a GSO send seen before segmentation) as those datagrams")

local function bit_set(value, mask)
    return math.floor(value / mask) % 2 == 1
end

-- Mark the datagram as one an aggregator drops as `reason`, with expert info saying why.
local function malformed(tree, item, reason, text)
    tree:add(f.drop, reason):set_generated()
    item:add_proto_expert_info(e[reason], text)
    return reason
end

-- One lane per NC8 code: the code, its sign and exponent code, and the value it stands for.
local function add_codes(tree, tvb, start, count, emin)
    for i = 0, count - 1 do
        local range = tvb(start + i, 1)
        local code = range:uint()
        local c = code % 128
        local value = 0.0
        if c > 0 then
            value = 2.0 ^ (emin + c - 1)
            if code >= 128 then value = -value end
        end
        local lane = tree:add(f.code, range)
        lane:prepend_text(string.format("[%d] ", i))
        lane:append_text(string.format(" = %s", c == 0 and "0" or string.format(
            "%s2^%d (%g)", code >= 128 and "-" or "+", emin + c - 1, value)))
        lane:add(f.code_sign, range)
        lane:add(f.code_exponent, range)
        lane:add(f.value, range, value):set_generated()
    end
end

-- One lane per sum (units of 2^e_min) of `width` bytes, int64 or int32, with the value it
-- stands for.
local function add_sums(tree, tvb, start, count, emin, width)
    for i = 0, count - 1 do
        local range = tvb(start + width * i, width)
        local sum = width == 8 and range:int64():tonumber() or range:int()
        local value = sum * 2.0 ^ emin
        local lane = tree:add(f.sum, range)
        lane:prepend_text(string.format("[%d] ", i))
        lane:append_text(string.format(" (%g)", value))
        lane:add(f.value, range, value):set_generated()
    end
end

local function add_blob(tree, tvb, start, size, count)
    local blob = tree:add(f.blob, tvb(start, size))
    if size >= 5 then
        blob:add(f.blob_method, tvb(start, 1))
        local item = blob:add(f.blob_count, tvb(start + 1, 4))
        if tvb(start + 1, 4):uint() ~= count then
            item:append_text(string.format(" (the header says %d: an aggregator drops it as "
                                           .. "bad_payload)", count))
        end
    end
end

-- The bitmap of a notice, and one generated item per rank whose contribution is held.
local function add_bitmap(tree, tvb, start)
    local item = tree:add(f.bitmap, tvb(start, NOTICE_SIZE))
    local ranks = {}
    for half = 0, 1 do -- the high word holds ranks 63..32, the low one 31..0
        local word = tvb(start + 4 * half, 4):uint()
        local base = 32 * (1 - half)
        for bit = 0, 31 do
            if math.floor(word / 2 ^ bit) % 2 == 1 then
                table.insert(ranks, base + bit)
            end
        end
    end
    table.sort(ranks)
    for _, rank in ipairs(ranks) do
        item:add(f.held, rank):set_generated()
    end
    item:append_text(#ranks == 0 and " (no contribution held)"
                     or " (ranks " .. table.concat(ranks, ", ") .. ")")
end

local function add_descriptor(tree, tvb, start)
    local d = tree:add(ncina, tvb(start, DESCRIPTOR_SIZE), "Job descriptor")
    d:add(f.status, tvb(start, 1))
    d:add(f.mode, tvb(start + 1, 1))
    d:add(f.e_max, tvb(start + 2, 1))
    d:add(f.e_min, tvb(start + 3, 1))
    d:add(f.workers, tvb(start + 4, 2))
    d:add(f.pool_size, tvb(start + 6, 2))
    d:add(f.k, tvb(start + 8, 2))
    d:add(f.keyed, tvb(start + 10, 1))
    d:add(f.uplink, tvb(start + 11, 1))
    d:add(f.compressor, tvb(start + 12, 4))
    d:add(f.rounding, tvb(start + 16, 1))
    return tvb(start, 1):uint()
end

-- ---- the authentication tag: keyed BLAKE2b (RFC 7693) with an 8-byte digest ----
-- Wireshark's UInt64 gives the 64-bit words (Lua 5.2 numbers are doubles); ncina.proto.tag is
-- the reference, and the tests compare with it.

local IV = {}
for i, hex in ipairs({ "6a09e667f3bcc908", "bb67ae8584caa73b", "3c6ef372fe94f82b",
                       "a54ff53a5f1d36f1", "510e527fade682d1", "9b05688c2b3e6c1f",
                       "1f83d9abfb41bd6b", "5be0cd19137e2179" }) do
    IV[i - 1] = UInt64.fromhex(hex)
end
local SIGMA = {
    { 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15 },
    { 14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3 },
    { 11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4 },
    { 7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8 },
    { 9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13 },
    { 2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9 },
    { 12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11 },
    { 13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10 },
    { 6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5 },
    { 10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0 },
}
local TAG_KEY = nil -- the key preference as a byte string (nil: no valid key set)

local function mix(v, a, b, c, d, x, y)
    v[a] = v[a] + v[b] + x
    v[d] = v[d]:bxor(v[a]):ror(32)
    v[c] = v[c] + v[d]
    v[b] = v[b]:bxor(v[c]):ror(24)
    v[a] = v[a] + v[b] + y
    v[d] = v[d]:bxor(v[a]):ror(16)
    v[c] = v[c] + v[d]
    v[b] = v[b]:bxor(v[c]):ror(63)
end

-- BLAKE2b's compression of one 128-byte block (a string) into h; t counts the bytes so far.
local function compress(h, block, t, last)
    local m, v = {}, {}
    for i = 0, 15 do
        local b = { block:byte(8 * i + 1, 8 * i + 8) }
        m[i] = UInt64.new(b[1] + b[2] * 0x100 + b[3] * 0x10000 + b[4] * 0x1000000,
                          b[5] + b[6] * 0x100 + b[7] * 0x10000 + b[8] * 0x1000000)
    end
    for i = 0, 7 do
        v[i], v[i + 8] = h[i], IV[i]
    end
    v[12] = v[12]:bxor(UInt64.new(t % 0x100000000, math.floor(t / 0x100000000)))
    if last then
        v[14] = v[14]:bnot()
    end
    for round = 0, 11 do
        local s = SIGMA[round % 10 + 1]
        mix(v, 0, 4, 8, 12, m[s[1]], m[s[2]])
        mix(v, 1, 5, 9, 13, m[s[3]], m[s[4]])
        mix(v, 2, 6, 10, 14, m[s[5]], m[s[6]])
        mix(v, 3, 7, 11, 15, m[s[7]], m[s[8]])
        mix(v, 0, 5, 10, 15, m[s[9]], m[s[10]])
        mix(v, 1, 6, 11, 12, m[s[11]], m[s[12]])
        mix(v, 2, 7, 8, 13, m[s[13]], m[s[14]])
        mix(v, 3, 4, 9, 14, m[s[15]], m[s[16]])
    end
    for i = 0, 7 do
        h[i] = h[i]:bxor(v[i], v[i + 8])
    end
end

-- The 8-byte tag of `message` under `key` (strings), as the little-endian word it is on the
-- wire (the first word of BLAKE2b's state).
local function tag_of(key, message)
    local h = {}
    for i = 0, 7 do
        h[i] = IV[i]
    end
    h[0] = h[0]:bxor(UInt64.new(0x01010000 + #key * 0x100 + TAG_SIZE, 0)) -- digest 8, keyed
    local data = key .. string.rep("\0", 128 - #key) .. message
    local done = 0
    while #data - done > 128 do
        compress(h, data:sub(done + 1, done + 128), done + 128, false)
        done = done + 128
    end
    local rest = #data - done
    compress(h, data:sub(done + 1) .. string.rep("\0", 128 - rest), #data, true)
    return h[0]
end

-- The key preference: 16 to 64 bytes of hex (spaces ignored), else no key.
local function parse_key(text)
    local hex = text:gsub("%s", "")
    if hex:find("^%x+$") == nil or #hex % 2 ~= 0 or #hex < 32 or #hex > 128 then
        return nil
    end
    return (hex:gsub("%x%x", function(pair) return string.char(tonumber(pair, 16)) end))
end

-- One datagram (the whole UDP payload, or one segment of a GSO super-packet): its tree under
-- `tree`; returns its summary for the Info column.
local function dissect_datagram(tvb, pinfo, tree)
    local size = tvb:len()
    local root = tree:add(ncina, tvb(), "ncina")
    if size < HEADER_SIZE then
        malformed(root, root, "truncated",
                  string.format("%d bytes, the header needs %d", size, HEADER_SIZE))
        return string.format("truncated datagram (%d bytes)", size)
    end
    local version = tvb(0, 1):uint()
    local flags = tvb(1, 1):uint()
    local fmt = tvb(2, 1):uint()
    local emin = tvb(3, 1):int()
    local job = tvb(4, 2):uint()
    local rank = tvb(6, 2):uint()
    local slot = tvb(8, 2):uint()
    local count = tvb(10, 2):uint()
    local offset = tvb(12, 4):uint()
    local is_result = bit_set(flags, FLAG_RESULT)
    local tagged = bit_set(flags, FLAG_TAG)

    local header = root:add(ncina, tvb(0, HEADER_SIZE), "Header")
    local version_item = header:add(f.version, tvb(0, 1))
    local flags_item = header:add(f.flags, tvb(1, 1))
    flags_item:add(f.flag_result, tvb(1, 1))
    flags_item:add(f.flag_retx, tvb(1, 1))
    flags_item:add(f.flag_pool, tvb(1, 1))
    flags_item:add(f.flag_generation, tvb(1, 1))
    flags_item:add(f.flag_tag, tvb(1, 1))
    local format_item = header:add(f.format, tvb(2, 1))
    header:add(f.emin, tvb(3, 1))
    header:add(f.job, tvb(4, 2))
    header:add(f.rank, tvb(6, 2))
    header:add(f.slot, tvb(8, 2))
    local count_item = header:add(f.count, tvb(10, 2))
    header:add(f.offset, tvb(12, 4))
    if fmt == FORMAT_JOB and not is_result and offset ~= 0 then
        header:add(f.nonce, tvb(12, 4))
    end
    if bit_set(flags, FLAG_RETX) then
        flags_item:add_proto_expert_info(e.retx)
    end

    local info = string.format("job=%d rank=%d", job, rank)
    if version ~= VERSION then
        malformed(root, version_item, "bad_version",
                  string.format("version %d, expected %d", version, VERSION))
        return string.format("unknown version %d", version)
    end

    -- With TAG the last 8 bytes are the tag, not payload (a datagram too short for its tag has
    -- an empty payload, as ncina.proto.header.parse takes it).
    local stop = size
    if tagged and size - HEADER_SIZE >= TAG_SIZE then
        stop = size - TAG_SIZE
    elseif tagged then
        stop = HEADER_SIZE
    end
    local payload_size = stop - HEADER_SIZE
    local kind, drop

    if fmt == FORMAT_JOB then
        -- A hello (worker) or a handshake answer (aggregator): exactly one descriptor.
        kind = is_result and "handshake answer" or "hello"
        local want = HEADER_SIZE + DESCRIPTOR_SIZE + (tagged and TAG_SIZE or 0)
        if size ~= want then
            drop = malformed(root, format_item, "bad_length",
                             string.format("a job datagram of %d bytes, not %d", size, want))
        elseif count ~= 1 then
            drop = malformed(root, count_item, "bad_count",
                             string.format("a job datagram of count %d, not 1", count))
        elseif is_result and pinfo.dst_port == ncina.prefs.port
                and pinfo.src_port ~= ncina.prefs.port then
            drop = malformed(root, flags_item, "bad_flags", "a hello with the RESULT flag")
        end
        info = string.format("%s, %s", kind, info)
        if drop == nil then
            local status = add_descriptor(root, tvb, HEADER_SIZE)
            if status ~= 0 then
                root:add_proto_expert_info(e.refused, STATUS[status] or
                                           string.format("status %d", status))
            end
            info = string.format("%s status=%s", info, STATUS[status] or tostring(status))
        end
    elseif is_result and count == 0 and (ELEMENT_SIZE[fmt] ~= nil or fmt == FORMAT_BLOB) then
        -- A notice: the answered packet's header, count 0, the contributors' bitmap; a
        -- restart notice (the answer to a stale packet) is the header alone.
        kind = "notice"
        local restart = HEADER_SIZE + (tagged and TAG_SIZE or 0)
        local want = restart + NOTICE_SIZE
        if size ~= want and size ~= restart then
            drop = malformed(root, count_item, "bad_length",
                             string.format("a notice of %d bytes, not %d or %d", size, want,
                                           restart))
        else
            if size == want then
                add_bitmap(root, tvb, HEADER_SIZE)
            end
            root:add_proto_expert_info(e.notice)
        end
        info = string.format("notice, %s slot=%d off=%d", info, slot, offset)
    else
        kind = is_result and "result" or "chunk"
        local element = ELEMENT_SIZE[fmt]
        if element == nil and fmt ~= FORMAT_BLOB then
            drop = malformed(root, format_item, "bad_format",
                             string.format("payload format %d", fmt))
        elseif count == 0 then
            drop = malformed(root, count_item, "bad_count", "zero elements")
        elseif fmt == FORMAT_BLOB and payload_size == 0 then
            drop = malformed(root, count_item, "bad_length", "empty blob payload")
        elseif element ~= nil and payload_size ~= count * element then
            drop = malformed(root, count_item, "bad_length", string.format(
                "%d payload bytes for %d elements of %d bytes", payload_size, count, element))
        end
        if payload_size > 0 then
            local payload = root:add(f.payload, tvb(HEADER_SIZE, payload_size))
            payload:append_text(string.format(" (%s, %d elements)", FORMATS[fmt] or "?", count))
            if drop == nil and fmt == FORMAT_NC8 then
                add_codes(payload, tvb, HEADER_SIZE, count, emin)
            elseif drop == nil and (fmt == FORMAT_INT or fmt == FORMAT_INT32) then
                add_sums(payload, tvb, HEADER_SIZE, count, emin, element)
            elseif drop == nil then
                add_blob(payload, tvb, HEADER_SIZE, payload_size, count)
            end
        end
        info = string.format("%s %s, %s slot=%d off=%d n=%d", FORMATS[fmt] or tostring(fmt),
                             kind, info, slot, offset, count)
    end

    if tagged and size - HEADER_SIZE >= TAG_SIZE then
        local tag_item = root:add(f.tag, tvb(size - TAG_SIZE, TAG_SIZE))
        if TAG_KEY ~= nil then
            local valid = tag_of(TAG_KEY, tvb:raw(0, size - TAG_SIZE))
                          == tvb(size - TAG_SIZE, TAG_SIZE):le_uint64()
            tag_item:add(f.tag_valid, valid):set_generated()
            if not valid then
                tag_item:add_proto_expert_info(e.bad_tag)
            end
        end
    end
    root:add(f.kind, kind):set_generated()
    root:append_text(string.format(", %s", kind))
    local marks = ""
    if bit_set(flags, FLAG_POOL) then marks = marks .. " POOL" end
    if bit_set(flags, FLAG_RETX) then marks = marks .. " RETX" end
    if tagged then marks = marks .. " TAG" end
    local generation = math.floor(flags / 8) % 16
    if generation ~= 0 then marks = marks .. string.format(" G=%d", generation) end
    if drop ~= nil then marks = marks .. " [" .. drop .. "]" end
    return info .. marks
end

-- The length a datagram starting at `start` must have, from its header: nil where the header
-- does not fix it (a blob, an unknown version or format) or where fewer bytes are left.
local function datagram_length(tvb, start)
    local left = tvb:len() - start
    if left < HEADER_SIZE or tvb(start, 1):uint() ~= VERSION then
        return nil
    end
    local flags = tvb(start + 1, 1):uint()
    local fmt = tvb(start + 2, 1):uint()
    local count = tvb(start + 10, 2):uint()
    local length
    if fmt == FORMAT_JOB then
        length = HEADER_SIZE + DESCRIPTOR_SIZE
    elseif bit_set(flags, FLAG_RESULT) and count == 0 and fmt <= FORMAT_BLOB then
        length = HEADER_SIZE + NOTICE_SIZE
    elseif ELEMENT_SIZE[fmt] ~= nil and count > 0 then
        length = HEADER_SIZE + count * ELEMENT_SIZE[fmt]
    else
        return nil
    end
    if bit_set(flags, FLAG_TAG) then
        length = length + TAG_SIZE
    end
    if length > left then
        return nil
    end
    return length
end

-- A sender with UDP GSO (UDP_SEGMENT: the socket backend sends runs of equal-length results
-- that way) hands the kernel one super-packet, which a capture on loopback or on a veth sees
-- whole: datagrams of one length back to back, the last one possibly shorter. Returns their
-- lengths when the payload is exactly that, else nil (one datagram, however malformed).
local function gso_segments(tvb)
    local size = tvb:len()
    local first = datagram_length(tvb, 0)
    if first == nil or first >= size then
        return nil
    end
    local lengths, start = {}, 0
    while start < size do
        local length = datagram_length(tvb, start)
        if length == nil or length > first or (length < first and start + length < size) then
            return nil
        end
        table.insert(lengths, length)
        start = start + length
    end
    return lengths
end

function ncina.dissector(tvb, pinfo, tree)
    pinfo.cols.protocol = "NCINA"
    local segments = ncina.prefs.gso and gso_segments(tvb) or nil
    if segments == nil then
        pinfo.cols.info = dissect_datagram(tvb, pinfo, tree)
        return tvb:len()
    end
    local start, first_info = 0, nil
    for _, length in ipairs(segments) do
        local info = dissect_datagram(tvb(start, length):tvb(), pinfo, tree)
        first_info = first_info or info
        start = start + length
    end
    local item = tree:add(f.segments, #segments):set_generated()
    item:add_proto_expert_info(e.gso, string.format("%d datagrams of one UDP GSO send",
                                                    #segments))
    pinfo.cols.info = string.format("%d datagrams (GSO): %s ...", #segments, first_info)
    return tvb:len()
end

local registered = nil

local function register(port)
    local udp = DissectorTable.get("udp.port")
    if registered ~= nil then
        udp:remove(registered, ncina)
    end
    udp:add(port, ncina)
    registered = port
end

function ncina.prefs_changed()
    TAG_KEY = parse_key(ncina.prefs.key)
    if ncina.prefs.port ~= registered then
        register(ncina.prefs.port)
    end
end

register(PORT)
DissectorTable.get("udp.port"):add_for_decode_as(ncina)
