package metrics

import (
	"slices"
	"time"

	"github.com/devicecompanion/companion"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/devicecompanion/companion/agent"
	"github.com/devicecompanion/companion/gatt"
	"github.com/devicecompanion/companion/topics"
)

// The bridge's results and kinds of transfer, in the order of their
// pre-bound series (its ops are topics.Ops).
var (
	bridgeResults = []string{companion.StateSucceeded, companion.StateFailed, companion.StateExpired}
	transferKinds = []string{"image", "app", "firmware"}
)

// bridgeOp are the pre-bound series of one op on the bridge.
type bridgeOp struct {
	done [3]prometheus.Counter // by index in bridgeResults
	took prometheus.Observer
}

// transferSeries are the pre-bound series of one kind of transfer.
type transferSeries struct {
	bytes      prometheus.Counter
	took       prometheus.Observer
	ok, failed prometheus.Counter
}

// BridgeOptions configure NewBridge.
type BridgeOptions struct {
	// Devices is the number of devices the bridge serves.
	Devices int
	// ConnectedDevices, when set, counts the devices with a live link; it
	// is called on every scrape.
	ConnectedDevices func() int
}

// Bridge holds the figures of companion-bridge. It implements
// agent.Observer and gatt.Observer; create it with NewBridge.
type Bridge struct {
	reg *prometheus.Registry

	doneV      *prometheus.CounterVec
	tookV      *prometheus.HistogramVec
	ops        map[string]*bridgeOp // read-only after NewBridge
	mqtt       prometheus.Gauge
	bytesV     *prometheus.CounterVec
	transferV  *prometheus.HistogramVec
	transfersV *prometheus.CounterVec
	transfers  map[string]*transferSeries // read-only after NewBridge
	drops      prometheus.Counter
	spool      prometheus.Gauge // 1 while the spool cannot be written
	unheard    prometheus.Counter
	refused    prometheus.Gauge
}

// NewBridge registers the bridge's metrics in a registry of its own.
func NewBridge(opts BridgeOptions) *Bridge {
	b := &Bridge{
		reg: newRegistry(),
		doneV: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "companion_bridge_commands_total",
			Help: "Commands the bridge ran to their end, by op and result (succeeded, failed, or expired before they ran).",
		}, []string{"op", "result"}),
		tookV: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "companion_bridge_command_duration_seconds",
			Help:    "Time the bridge took to run a command on its device (blob download included), by op.",
			Buckets: commandBuckets,
		}, []string{"op"}),
		mqtt: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "companion_bridge_mqtt_connected",
			Help: "1 while the bridge's MQTT connection is up and subscribed, else 0.",
		}),
		bytesV: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "companion_bridge_gatt_transfer_bytes_total",
			Help: "Data bytes sent over Bluetooth by chunked uploads that ended (chunks repeated after a dropped link included), by kind.",
		}, []string{"kind"}),
		transferV: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "companion_bridge_gatt_transfer_duration_seconds",
			Help:    "Time a chunked upload over Bluetooth took, reconnects included, by kind.",
			Buckets: transferBuckets,
		}, []string{"kind"}),
		transfersV: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "companion_bridge_gatt_transfers_total",
			Help: "Chunked uploads over Bluetooth that ended, by kind and result (ok, failed).",
		}, []string{"kind", "result"}),
		drops: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "companion_bridge_gatt_link_drops_total",
			Help: "Bluetooth links found down that the bridge had not closed (lost, dropped by the device, or closed after a request timed out).",
		}),
		spool: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "companion_bridge_spool_unwritable",
			Help: "1 while the bridge's spool cannot be written (its disk full, a quota, a file size limit, a failing disk): it takes no command in meanwhile; else 0.",
		}),
		unheard: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "companion_bridge_replies_unheard_total",
			Help: "Commands the server sent again and again after the bridge had finished and answered them: their replies do not reach the server (the broker's ACLs may drop the bridge's publishes).",
		}),
		refused: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "companion_bridge_devices_refused",
			Help: "Devices whose command subscription the broker refuses (SUBACK 0x80): served through another bridge, or all of them with a --topic-prefix or rights that do not match the server's.",
		}),
		ops:       make(map[string]*bridgeOp, len(topics.Ops)),
		transfers: make(map[string]*transferSeries, len(transferKinds)),
	}
	b.reg.MustRegister(b.doneV, b.tookV, b.mqtt, b.bytesV, b.transferV, b.transfersV, b.drops, b.spool, b.unheard, b.refused)
	devices := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "companion_bridge_devices",
		Help: "Devices the bridge serves (--sim-devices or --devices).",
	})
	devices.Set(float64(opts.Devices))
	b.reg.MustRegister(devices)
	if opts.ConnectedDevices != nil {
		b.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "companion_bridge_devices_connected",
			Help: "Devices with a live Bluetooth link now.",
		}, func() float64 { return float64(opts.ConnectedDevices()) }))
	}
	for _, op := range topics.Ops {
		o := &bridgeOp{took: b.tookV.WithLabelValues(op)}
		for i, r := range bridgeResults {
			o.done[i] = b.doneV.WithLabelValues(op, r)
		}
		b.ops[op] = o
	}
	for _, k := range transferKinds {
		b.transfers[k] = b.transferSeries(k)
	}
	return b
}

func (b *Bridge) transferSeries(kind string) *transferSeries {
	return &transferSeries{
		bytes:  b.bytesV.WithLabelValues(kind),
		took:   b.transferV.WithLabelValues(kind),
		ok:     b.transfersV.WithLabelValues(kind, "ok"),
		failed: b.transfersV.WithLabelValues(kind, "failed"),
	}
}

// Registry is where the bridge's metrics are registered.
func (b *Bridge) Registry() *prometheus.Registry { return b.reg }

// CommandDone counts a command the bridge ended and, when it ran, observes
// how long it ran.
func (b *Bridge) CommandDone(op, result string, ran bool, took time.Duration) {
	o, i := b.ops[op], slices.Index(bridgeResults, result)
	if o == nil || i < 0 {
		// An op no bridge runs (it fails at once) or an unknown result:
		// counted all the same; the op is one the server sent, so the
		// labels stay bounded by what the server knows.
		if topics.ValidOp(op) {
			b.doneV.WithLabelValues(op, result).Inc()
		} else {
			b.doneV.WithLabelValues("other", result).Inc()
		}
		return
	}
	o.done[i].Inc()
	if ran { // not one expired, nor failed device_not_served at start (bug 361)
		o.took.Observe(took.Seconds())
	}
}

// MQTTConnected sets the connection gauge.
func (b *Bridge) MQTTConnected(up bool) { b.mqtt.Set(gauge01(up)) }

// Transfer counts an upload that ended, its bytes and its time.
func (b *Bridge) Transfer(kind string, bytesSent int64, took time.Duration, failed bool) {
	t := b.transfers[kind]
	if t == nil {
		t = b.transferSeries("other")
	}
	t.bytes.Add(float64(bytesSent))
	t.took.Observe(took.Seconds())
	if failed {
		t.failed.Inc()
	} else {
		t.ok.Inc()
	}
}

// SpoolWritable sets the spool gauge: 1 while its writes fail.
func (b *Bridge) SpoolWritable(ok bool) { b.spool.Set(gauge01(!ok)) }

// ReplyUnheard counts a command whose replies do not reach the server.
func (b *Bridge) ReplyUnheard() { b.unheard.Inc() }

// DevicesRefused sets the gauge of devices whose commands the broker refuses.
func (b *Bridge) DevicesRefused(n int) { b.refused.Set(float64(n)) }

// LinkLost counts a dropped Bluetooth link.
func (b *Bridge) LinkLost() { b.drops.Inc() }

// The bridge's metrics serve what these packages ask of an observer.
var (
	_ agent.Observer = (*Bridge)(nil)
	_ gatt.Observer  = (*Bridge)(nil)
)
