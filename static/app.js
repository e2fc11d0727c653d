// Streaming demo for the CosyVoice gateway (protocol: docs/protocol.md).
// Plain browser JavaScript, no build step, no external files.
//
// Flow: the text is cut into LLM-like tokens and sent to /v1/tts/stream one `text`
// message at a time at the chosen rate; binary audio frames come back and are decoded
// (Opus through WebCodecs where the browser has it, else 16-bit PCM) and scheduled
// back to back on one AudioContext clock, so chunks join without gaps. The AudioContext
// runs at the stream's own rate (48 kHz Opus, 24 kHz PCM): the chunks are not resampled
// one by one (each small buffer resampled on its own clicks at every join), the browser
// resamples the context's output to the device as one continuous signal. Stop sends a
// real `cancel` (barge-in) and silences what was already scheduled.
//
// `window.demo.state` exposes counters (scheduled buffers/seconds of the current turn,
// first-audio time, events) and every change dispatches a `demo:change` event, so tests
// can wait on the page's own state instead of guessing with timers.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const PCM_RATE = 24000;   // the engine's rate: no resampling on the server
  const OPUS_RATE = 48000;
  const MAX_UPLOAD_BYTES = 20 * 1024 * 1024; // the server's default voices.max_upload_bytes
  const LEAD_S = 0.06;      // scheduling head-room so the first chunk is not clipped
  const MAX_LOG = 200;      // events kept in the log (and in state.events / state.errors)

  const state = {
    connected: false,
    sessionId: null,
    contextId: null,
    speaking: false,
    format: null,            // "opus" | "pcm_s16le" of the current context
    limits: null,            // the server's limits (session_started)
    textSentAt: null,        // performance.now() of the first text message
    firstAudioMs: null,      // first audio frame received - first text sent
    scheduledBuffers: 0,     // AudioBufferSourceNodes started (this turn)
    scheduledSeconds: 0,     // audio scheduled (this turn)
    peak: 0,                 // largest |sample| scheduled this turn (0 would mean silence)
    framesReceived: 0,
    framesAfterCancel: 0,    // audio frames for a context after its `cancelled` (must stay 0)
    segments: [],            // segment_started events of the current context
    currentSegment: null,
    tokensSent: 0,
    cancelled: null,         // the server's `cancelled` event after Stop
    heardSeconds: null,      // audio played when Stop was pressed
    recordingSeconds: 0,     // microphone recording in progress
    recorded: null,          // {bytes, type, seconds} of the last recording
    registered: null,        // the voice the last upload registered
    uploadError: null,
    done: null,              // the server's `done` event
    failed: null,            // the `final` error that ended this turn (no `done` follows)
    textDropped: null,       // a `text_too_long` error: some text of this turn was not taken
    errors: [],
    events: [],              // every server event (JSON), in order
  };
  const changed = () => window.dispatchEvent(new CustomEvent("demo:change"));

  // ---- settings persisted in the browser ------------------------------------------
  const apiKeyInput = $("api-key");
  apiKeyInput.value = localStorage.getItem("cosyvoice.apiKey") || "";
  apiKeyInput.addEventListener("change", () => {
    localStorage.setItem("cosyvoice.apiKey", apiKeyInput.value.trim());
    closeSocket();
    loadVoices();
  });
  const authHeaders = () => (apiKeyInput.value.trim() ? { Authorization: `Bearer ${apiKeyInput.value.trim()}` } : {});

  for (const [input, out, fmt] of [["rate", "rate-out", (v) => v], ["speed", "speed-out", (v) => Number(v).toFixed(2)]]) {
    $(input).addEventListener("input", () => { $(out).textContent = fmt($(input).value); });
  }

  // ---- voices -------------------------------------------------------------------------
  async function loadVoices() {
    const select = $("voice");
    const keep = select.value;
    try {
      const resp = await fetch("/v1/voices", { headers: authHeaders() });
      if (!resp.ok) {
        const body = await resp.json().catch(() => ({}));
        throw new Error(resp.status === 401 ? "API key required" : (body.error && body.error.message) || `HTTP ${resp.status}`);
      }
      const body = await resp.json();
      select.replaceChildren(new Option("(server default)", ""));
      for (const v of body.data) {
        select.append(new Option(`${v.name || v.id} (${v.duration_s.toFixed(1)} s)`, v.id));
      }
      if ([...select.options].some((o) => o.value === keep)) select.value = keep;
    } catch (err) {
      setStatus("nv-status", `voices: ${err.message}`);
      setConn("error", `voices: ${err.message}`); // beside the voice list, not in the folded form
    }
    changed();
  }
  $("reload-voices").addEventListener("click", loadVoices);

  let recorded = null; // Blob from the microphone
  let recorder = null;
  $("nv-record").addEventListener("click", async () => {
    if (recorder && recorder.state === "recording") { recorder.stop(); return; }
    if (!navigator.mediaDevices) { setStatus("nv-status", "microphone: needs HTTPS (or localhost)"); return; }
    let stream = null;
    try {
      stream = await navigator.mediaDevices.getUserMedia({ audio: true });
      const parts = [];
      const started = performance.now();
      recorder = new MediaRecorder(stream);
      recorder.ondataavailable = (e) => {
        parts.push(e.data);
        state.recordingSeconds = (performance.now() - started) / 1000;
        setStatus("nv-status", `recording… ${state.recordingSeconds.toFixed(1)} s`);
        changed();
      };
      recorder.onstop = () => {
        stream.getTracks().forEach((t) => t.stop());
        recorded = new Blob(parts, { type: recorder.mimeType });
        state.recorded = { bytes: recorded.size, type: recorded.type, seconds: state.recordingSeconds };
        setPreview(URL.createObjectURL(recorded));
        $("nv-record").textContent = "● Record";
        $("nv-record").setAttribute("aria-label", "Record a clip");
        setStatus("nv-status", `recorded ${state.recordingSeconds.toFixed(1)} s (${(recorded.size / 1024).toFixed(0)} KiB)`);
        changed();
      };
      recorder.start(250); // a chunk every 250 ms: the elapsed time is shown while recording
      $("nv-record").textContent = "■ Stop recording";
      $("nv-record").setAttribute("aria-label", "Stop recording");
      const mine = recorder; // an older timer must not stop a later recording
      setTimeout(() => mine.state === "recording" && mine.stop(), 12000);
    } catch (err) {
      if (stream) stream.getTracks().forEach((t) => t.stop()); // the microphone goes off again
      setStatus("nv-status", `microphone: ${err.message}`);
    }
  });
  $("nv-file").addEventListener("change", () => { recorded = null; setPreview(null); });

  function setPreview(url) {
    // One preview at a time: the last recording's object URL is freed (it holds the Blob).
    const preview = $("nv-preview");
    if (preview.src.startsWith("blob:")) URL.revokeObjectURL(preview.src);
    if (url) preview.src = url; else preview.removeAttribute("src");
    preview.hidden = !url;
  }

  $("nv-upload").addEventListener("click", async () => {
    const file = recorded || $("nv-file").files[0];
    if (!file) { setStatus("nv-status", "choose a file or record first"); return; }
    const form = new FormData();
    const ext = (file.type.split("/")[1] || "bin").split(";")[0];
    form.append("file", file, file.name || `recording.${ext}`);
    form.append("transcript", $("nv-text").value);
    if ($("nv-id").value.trim()) form.append("id", $("nv-id").value.trim());
    if (file.size > MAX_UPLOAD_BYTES) {
      setStatus("nv-status", `error: the file is ${(file.size / 1048576).toFixed(1)} MiB; at most 20 MiB`);
      return;
    }
    setStatus("nv-status", "uploading…");
    $("nv-upload").disabled = true; // a second click would register the id twice (409)
    let resp, body;
    try {
      resp = await fetch("/v1/voices", { method: "POST", body: form, headers: authHeaders() });
      body = await resp.json().catch(() => ({}));
    } catch (err) {
      resp = null;
      body = { error: { message: `upload failed (${err.message})` } };
    } finally {
      $("nv-upload").disabled = false;
    }
    if (!resp || !resp.ok) {
      state.uploadError = (body.error && body.error.message) || `HTTP ${resp.status}`;
      setStatus("nv-status", `error: ${state.uploadError}`);
      changed();
      return;
    }
    setStatus("nv-status", `registered "${body.id}"`);
    await loadVoices();
    $("voice").value = body.id;
    state.registered = body;
    changed();
  });

  function setStatus(id, text) { $(id).textContent = text; }

  // ---- audio output: gapless scheduling on the AudioContext clock ----------------------
  class Player {
    // An AudioContext at the stream's rate. Chromium resamples an AudioBuffer of another
    // rate than its context's buffer by buffer, each on its own (no state across them), so
    // 20 ms chunks played back to back click at every join (~40 times a second on a 44.1 kHz
    // device). At the stream's rate the chunks are played as they are and the context's
    // output is resampled to the device as one continuous stream.
    constructor(rate) {
      this.rate = rate || null; // the rate asked for; the browser may not honour it
      let ctx = null;
      if (rate) {
        try { ctx = new AudioContext({ latencyHint: "interactive", sampleRate: rate }); } catch (_) { /* unsupported rate */ }
      }
      this.ctx = ctx || new AudioContext({ latencyHint: "interactive" });
      this.analyser = this.ctx.createAnalyser();
      this.analyser.fftSize = 2048;
      this.analyser.connect(this.ctx.destination);
      this.reset();
    }
    reset() {
      this.nextFrame = 0; // where the next chunk starts, in frames of the context's clock
      this.sources = [];
      this.timeline = []; // {t0, dur}: where each buffer of this context sits on the clock
      this.rs = null;     // streaming resampler for chunks at another rate than the context's
    }
    get nextTime() { return this.nextFrame / this.ctx.sampleRate; }
    schedule(samples, rate) {
      if (!samples.length) return;
      const sr = this.ctx.sampleRate;
      // Never a buffer at another rate: that would be resampled on its own (a click at each join).
      if (rate !== sr) samples = this.resample(samples, rate);
      if (!samples.length) return;
      const buffer = this.ctx.createBuffer(1, samples.length, sr);
      buffer.copyToChannel(samples, 0);
      const src = this.ctx.createBufferSource();
      src.buffer = buffer;
      src.connect(this.analyser);
      // Back to back, on whole frames: the next chunk starts where the previous one ends,
      // unless we fell behind (network or engine gap), then as soon as possible.
      const start = Math.max(this.nextFrame, Math.ceil((this.ctx.currentTime + LEAD_S) * sr));
      const t0 = start / sr;
      src.start(t0);
      this.nextFrame = start + samples.length;
      this.sources.push(src);
      src.onended = () => { this.sources = this.sources.filter((s) => s !== src); };
      this.timeline.push({ t0, dur: buffer.duration });
      state.scheduledBuffers += 1;
      state.scheduledSeconds += buffer.duration;
      for (let i = 0; i < samples.length; i++) state.peak = Math.max(state.peak, Math.abs(samples[i]));
    }
    resample(samples, rate) {
      // Only where the context could not be opened at the stream's rate: linear
      // interpolation whose position and last sample carry over from chunk to chunk, so
      // the stream stays one continuous signal. x[0] is the previous chunk's last sample,
      // x[k] = samples[k - 1]; `pos` is the next output's position on that axis.
      if (!this.rs || this.rs.rate !== rate) this.rs = { rate, pos: 1, prev: 0 };
      const rs = this.rs;
      const step = rate / this.ctx.sampleRate;
      const n = samples.length;
      const out = new Float32Array(Math.max(0, Math.ceil((n - rs.pos) / step) + 2));
      let k = 0;
      let pos = rs.pos;
      while (pos <= n) { // ends with pos > n: the next chunk starts past its x[0]
        const i = Math.floor(pos);
        const f = pos - i;
        const a = i === 0 ? rs.prev : samples[i - 1];
        const b = i < n ? samples[i] : a;
        out[k++] = a + (b - a) * f;
        pos += step;
      }
      rs.pos = pos - n;
      rs.prev = samples[n - 1];
      return out.subarray(0, k);
    }
    playedSeconds() {
      const now = this.ctx.currentTime;
      let played = 0;
      for (const { t0, dur } of this.timeline) played += Math.min(Math.max(now - t0, 0), dur);
      return played;
    }
    stopAll() {
      for (const s of this.sources) { try { s.stop(); } catch (_) { /* not started */ } }
      this.sources = [];
      this.nextFrame = 0;
      this.rs = null;
      // Freeze the timeline at "now" so the played time stays what was really heard.
      const now = this.ctx.currentTime;
      this.timeline = this.timeline.map(({ t0, dur }) => ({ t0, dur: Math.min(Math.max(now - t0, 0), dur) }));
    }
    close() {
      this.stopAll();
      this.ctx.close().catch(() => { /* already closed */ });
    }
  }
  let player = null;
  // The player for a stream at `rate`: a turn at another rate than the last one's gets a
  // context of its own (turns never overlap: the old one was stopped or has finished).
  const getPlayer = (rate) => {
    if (player && rate && player.rate !== rate) { player.close(); player = null; }
    return (player ||= new Player(rate));
  };

  // ---- decoders ---------------------------------------------------------------------
  let opusCheck = null; // asked once: the answer does not change while the page lives
  function opusSupported() { return (opusCheck ||= checkOpus()); }
  async function checkOpus() {
    if (typeof AudioDecoder === "undefined") return false;
    try {
      const r = await AudioDecoder.isConfigSupported({ codec: "opus", sampleRate: OPUS_RATE, numberOfChannels: 1 });
      return !!r.supported;
    } catch (_) { return false; }
  }

  class OpusDecoderStream {
    // One WebCodecs decoder per context (Opus state must not cross contexts).
    constructor(onPcm) {
      this.ts = 0;
      this.decoder = new AudioDecoder({
        output: (data) => {
          const pcm = new Float32Array(data.numberOfFrames);
          data.copyTo(pcm, { planeIndex: 0, format: "f32-planar" });
          onPcm(pcm, data.sampleRate);
          data.close();
        },
        error: (e) => {
          // WebCodecs closes a decoder on error: every later decode() would throw.
          this.failed = true;
          logEvent({ type: "decoder_error", message: String(e) });
          $("state").textContent = "Opus decoder failed";
        },
      });
      this.decoder.configure({ codec: "opus", sampleRate: OPUS_RATE, numberOfChannels: 1 });
    }
    push(packet) {
      if (this.failed || this.decoder.state !== "configured") return;
      this.decoder.decode(new EncodedAudioChunk({ type: "key", timestamp: this.ts, data: packet }));
      this.ts += 20000; // µs: one 20 ms packet
    }
    close() { try { this.decoder.close(); } catch (_) { /* closed */ } }
  }

  function pcm16ToFloat(bytes) {
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    const out = new Float32Array(bytes.byteLength >> 1);
    for (let i = 0; i < out.length; i++) out[i] = view.getInt16(2 * i, true) / 32768;
    return out;
  }

  // ---- the WebSocket ------------------------------------------------------------------
  let ws = null;
  let wsReady = null;
  let decoder = null;      // OpusDecoderStream of the current context
  const cancelledIds = new Set(); // the server confirmed `cancelled`
  const stoppedIds = new Set();   // Stop pressed here: frames still in flight are dropped
  const failedIds = new Set();    // a `final` error ended the turn: its later audio and events are ignored
  const remember = (set, id) => {  // bounded: the oldest ids go first
    set.add(id);
    if (set.size > MAX_LOG) set.delete(set.values().next().value);
  };
  let tokenTimer = null;
  let contextCounter = 0;

  function closeSocket() {
    if (ws) ws.close(1000);
    ws = null;
    wsReady = null;
    state.connected = false;
    setConn("idle", "disconnected");
    finishTurn();
  }

  function connect() {
    if (wsReady) return wsReady;
    const proto = location.protocol === "https:" ? "wss" : "ws";
    const key = apiKeyInput.value.trim();
    const url = `${proto}://${location.host}/v1/tts/stream${key ? `?token=${encodeURIComponent(key)}` : ""}`;
    wsReady = new Promise((resolve, reject) => {
      const sock = new WebSocket(url);
      sock.binaryType = "arraybuffer";
      sock.onmessage = (msg) => {
        if (typeof msg.data === "string") {
          const ev = JSON.parse(msg.data);
          if (ev.type === "session_started") { state.sessionId = ev.session_id; state.limits = ev.limits || null; resolve(sock); }
          onEvent(ev);
        } else {
          onAudio(new Uint8Array(msg.data));
        }
      };
      sock.onclose = (e) => {
        const why = e.code === 1008 ? "unauthorized: set the API key" : `closed (${e.code}${e.reason ? " " + e.reason : ""})`;
        reject(new Error(why));
        if (ws !== sock) return; // a socket replaced on purpose: the new one carries on
        const inTurn = state.speaking;
        // 4000: the server's idle timeout (no turn for a while), not a failure.
        if (e.code === 4000) setConn("idle", "idle, reconnects on Speak");
        else setConn(e.code === 1000 ? "idle" : "error", why);
        state.connected = false;
        ws = null; wsReady = null;
        finishTurn();
        if (inTurn) $("state").textContent = `connection lost: ${why}`;
        changed();
      };
      sock.onopen = () => { state.connected = true; setConn("open", "connected"); changed(); };
      ws = sock;
    });
    return wsReady;
  }

  function setConn(kind, text) { $("conn").dataset.state = kind; $("conn").textContent = text; }
  const send = (msg) => ws && ws.readyState === WebSocket.OPEN && ws.send(JSON.stringify(msg));

  function logEvent(ev) {
    // The last MAX_LOG events only: a long session must not grow the list (and the DOM) without end.
    state.events.push(ev);
    if (state.events.length > MAX_LOG) state.events.splice(0, state.events.length - MAX_LOG);
    const list = $("events");
    const li = document.createElement("li");
    const { type, ...rest } = ev;
    li.textContent = `${type} ${JSON.stringify(rest)}`.slice(0, 240);
    list.append(li);
    while (list.childElementCount > MAX_LOG) list.firstElementChild.remove();
    list.scrollTop = list.scrollHeight;
  }

  function onEvent(ev) {
    logEvent(ev);
    if (ev.type === "error") {
      state.errors.push(ev);
      if (state.errors.length > MAX_LOG) state.errors.splice(0, state.errors.length - MAX_LOG);
      if (ev.code === "unauthorized") setConn("error", "unauthorized: set the API key");
    }
    // A turn that failed is over: what its id still brings (a context that text already on
    // the wire opened after the refusal, the `cancelled` that closes it) is only logged.
    const mine = ev.context_id === state.contextId && !failedIds.has(ev.context_id);
    switch (ev.type) {
      case "context_started":
        if (mine) { state.format = ev.format; $("codec").textContent = `${ev.format} ${ev.sample_rate / 1000} kHz`; }
        break;
      case "segment_started":
        if (mine) { state.segments.push(ev); renderTranscript(); }
        break;
      case "done":
        if (mine) { state.done = ev; finishTurn(); }
        break;
      case "cancelled":
        remember(cancelledIds, ev.context_id);
        if (mine) { state.cancelled = ev; finishTurn(); }
        break;
      case "error":
        if (!mine) break;
        // `final`: the server refused or ended this turn's context; no `done` will come.
        if (ev.final) { failTurn(ev); break; }
        if (!state.speaking) break;
        if (ev.code === "text_too_long") {
          // The server did not take this piece's text (the context is over its limit), but
          // its `end` still applies: the text before it is spoken and `done` follows.
          state.textDropped = ev;
          $("state").textContent = `streaming (${droppedNotice()})`;
          break;
        }
        $("state").textContent = `streaming (server: ${ev.code}: ${ev.message})`;
        // A refused piece may have carried `end`: then nothing would end the turn. Ending it
        // again is harmless (an ended context ignores a second `end`) and keeps what was taken.
        if (["invalid_message", "message_too_large"].includes(ev.code) && state.tokensSent === state.tokensTotal && !state.endResent) {
          state.endResent = true;
          send({ type: "end", context_id: state.contextId });
        }
        break;
    }
    changed();
  }

  function droppedNotice() {
    const max = state.limits && state.limits.max_text_chars;
    return `part of the text was dropped: over the server's limit${max ? ` of ${max} characters a turn` : ""}`;
  }

  function failTurn(ev) {
    // No more text: the pieces already on the wire reach the server after the refusal, and
    // the first of them opens a new context under this id with the socket's defaults. A
    // `cancel` sent now comes after all of them (one socket is ordered), so it closes that
    // context (or is answered `cancelled` with `active: false` when none was opened).
    const cid = ev.context_id;
    if (tokenTimer) { clearTimeout(tokenTimer); tokenTimer = null; }
    remember(failedIds, cid);
    // Audio that came before the failure plays on; what comes after it is dropped (onAudio).
    send({ type: "cancel", context_id: cid });
    state.failed = ev;
    finishTurn();
  }

  function onAudio(frame) {
    const n = frame[0];
    const cid = new TextDecoder().decode(frame.subarray(1, 1 + n));
    const payload = frame.subarray(1 + n);
    if (cancelledIds.has(cid)) { state.framesAfterCancel += 1; changed(); return; }
    if (cid !== state.contextId || stoppedIds.has(cid) || failedIds.has(cid)) return;
    state.framesReceived += 1;
    if (state.firstAudioMs === null && state.textSentAt !== null) {
      state.firstAudioMs = performance.now() - state.textSentAt;
      $("ttfa").textContent = `${Math.round(state.firstAudioMs)} ms`;
    }
    if (state.format === "opus" && decoder) {
      decoder.push(payload);
    } else {
      getPlayer().schedule(pcm16ToFloat(payload), PCM_RATE);
      changed();
    }
  }

  // ---- a turn: stream tokens in, audio out --------------------------------------------
  function tokenize(text) {
    // LLM-like pieces: a leading space stays with its word, long words are split.
    const pieces = [];
    for (const m of text.matchAll(/\s*[^\s]+|\s+$/g)) {
      // By code point: a UTF-16 cut inside an emoji would send a lone surrogate, which
      // the server refuses (the piece, and an `end` it carried, would be lost).
      const word = [...m[0]];
      for (let i = 0; i < word.length; i += 6) pieces.push(word.slice(i, i + 6).join(""));
    }
    return pieces;
  }

  let starting = false;
  async function speak() {
    const text = $("text").value;
    if (!text.trim() || starting) return;
    starting = true;
    $("speak").disabled = true; // a second click while this one awaits would open a second context
    try { await startTurn(text); } finally { starting = false; if (!state.speaking) $("speak").disabled = false; }
  }

  async function startTurn(text) {
    if (state.speaking) await stop();
    const choice = $("format").value;
    const canOpus = choice !== "pcm" && (await opusSupported());
    const useOpus = canOpus && (choice === "opus" || choice === "auto");
    const p = getPlayer(useOpus ? OPUS_RATE : PCM_RATE);
    if (p.ctx.state === "suspended") await p.ctx.resume();
    let sock;
    try { sock = await connect(); } catch (err) { setConn("error", err.message); return; }

    if (choice === "opus" && !canOpus) {
      logEvent({ type: "notice", message: "this browser cannot decode Opus (WebCodecs needs HTTPS or localhost): PCM instead" });
    }
    contextCounter += 1;
    const cid = `demo-${Date.now().toString(36)}-${contextCounter}`;
    Object.assign(state, {
      contextId: cid, speaking: true, format: useOpus ? "opus" : "pcm_s16le", textSentAt: null, firstAudioMs: null,
      segments: [], currentSegment: null, tokensSent: 0, tokensTotal: 0, cancelled: null, done: null, heardSeconds: null,
      failed: null, textDropped: null, endResent: false, scheduledBuffers: 0, scheduledSeconds: 0, peak: 0,
    });
    p.stopAll();
    p.reset();
    if (decoder) decoder.close();
    decoder = useOpus ? new OpusDecoderStream((pcm, rate) => { p.schedule(pcm, rate); changed(); }) : null;
    $("ttfa").textContent = "…";
    $("segment").textContent = "—";
    $("played").textContent = "0.00 s";
    $("transcript").replaceChildren();
    $("speak").disabled = true;
    $("stop").disabled = false;
    $("state").textContent = "streaming";

    const overrides = useOpus ? { format: "opus", sample_rate: OPUS_RATE } : { format: "pcm_s16le", sample_rate: PCM_RATE };
    if ($("voice").value) overrides.voice = $("voice").value;
    overrides.speed = Number($("speed").value);

    const tokens = tokenize(text);
    state.tokensTotal = tokens.length;
    const interval = 1000 / Number($("rate").value);
    let i = 0;
    const sendNext = () => {
      tokenTimer = null;
      if (state.contextId !== cid || sock.readyState !== WebSocket.OPEN) return;
      const msg = { type: "text", context_id: cid, text: tokens[i] };
      if (i === 0) { Object.assign(msg, overrides); state.textSentAt = performance.now(); }
      i += 1;
      if (i === tokens.length) msg.end = true;
      sock.send(JSON.stringify(msg));
      state.tokensSent = i;
      changed();
      if (i < tokens.length) tokenTimer = setTimeout(sendNext, interval);
    };
    sendNext();
  }

  async function stop() {
    // Barge-in: no more text, the server cancels the context (drops queued frames,
    // aborts the LM), and audio already scheduled here is silenced at once.
    if (tokenTimer) { clearTimeout(tokenTimer); tokenTimer = null; }
    const cid = state.contextId;
    if (cid) {
      remember(stoppedIds, cid);
      if (!state.cancelled) send({ type: "cancel", context_id: cid }); // idempotent on the server
    }
    if (decoder) { decoder.close(); decoder = null; } // packets queued in it are not played
    if (player) {
      state.heardSeconds = player.playedSeconds();
      player.stopAll();
      $("played").textContent = `${state.heardSeconds.toFixed(2)} s`;
    }
    markHeard(true);
    finishTurn();
    changed();
  }

  function finishTurn() {
    if (tokenTimer) { clearTimeout(tokenTimer); tokenTimer = null; }
    state.speaking = false;
    $("speak").disabled = false;
    $("state").textContent = state.failed ? `failed: ${state.failed.code}`
      : state.cancelled ? "stopped (cancelled)"
      : state.done ? (state.textDropped ? `done (${droppedNotice()})` : "done")
      : "idle";
  }

  // ---- display ------------------------------------------------------------------------
  function renderTranscript() {
    const root = $("transcript");
    root.replaceChildren(...state.segments.map((s, k) => {
      const span = document.createElement("span");
      span.className = "seg";
      span.dataset.k = String(k);
      span.textContent = s.text;
      return span;
    }));
  }

  function segmentAt(seconds) {
    // The segment whose first sample has been played (offsets are at the context rate).
    let cur = null;
    for (const s of state.segments) if (s.audio_offset_ms / 1000 <= seconds) cur = s;
    return cur;
  }

  function markHeard(cut) {
    if (!player) return;
    const played = player.playedSeconds();
    const cur = played > 0 ? segmentAt(played) : null;
    for (const span of $("transcript").children) {
      const s = state.segments[Number(span.dataset.k)];
      span.classList.toggle("speaking", s === cur && !cut);
      span.classList.toggle("spoken", s.audio_offset_ms / 1000 <= played && (s !== cur || cut));
      span.classList.toggle("cut", cut && s.audio_offset_ms / 1000 > played);
    }
    if (cur !== state.currentSegment) {
      state.currentSegment = cur;
      $("segment").textContent = cur ? cur.text.trim() : "—";
      changed();
    }
  }

  const canvas = $("wave");
  const g = canvas.getContext("2d");
  let wave = null;
  function draw() {
    requestAnimationFrame(draw);
    const w = canvas.width, h = canvas.height;
    g.fillStyle = "#0b1016";
    g.fillRect(0, 0, w, h);
    g.strokeStyle = "#2a3540";
    g.beginPath(); g.moveTo(0, h / 2); g.lineTo(w, h / 2); g.stroke();
    if (!player) return;
    wave ||= new Float32Array(player.analyser.fftSize);
    player.analyser.getFloatTimeDomainData(wave);
    // Mild automatic gain (1x..8x) so quiet speech is still visible.
    let peak = 0;
    for (let i = 0; i < wave.length; i++) peak = Math.max(peak, Math.abs(wave[i]));
    const gain = Math.min(8, Math.max(1, 0.8 / Math.max(peak, 1e-4)));
    g.strokeStyle = "#4cc2ff";
    g.lineWidth = 2;
    g.beginPath();
    for (let i = 0; i < wave.length; i++) {
      const x = (i / (wave.length - 1)) * w;
      const y = h / 2 - wave[i] * gain * (h / 2) * 0.95;
      i ? g.lineTo(x, y) : g.moveTo(x, y);
    }
    g.stroke();
    // Stop stays available while audio is still playing after the server finished.
    $("stop").disabled = !(state.speaking || player.nextTime > player.ctx.currentTime);
    $("scheduled").textContent = `${state.scheduledSeconds.toFixed(2)} s`;
    if (state.contextId && (state.speaking || state.done)) {
      $("played").textContent = `${player.playedSeconds().toFixed(2)} s`;
      markHeard(false);
    }
  }
  requestAnimationFrame(draw);

  $("speak").addEventListener("click", speak);
  $("stop").addEventListener("click", stop);
  window.demo = { state, speak, stop, connect, loadVoices, opusSupported, player: () => player };
  loadVoices();
})();
