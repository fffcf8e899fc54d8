package pahostore

import (
	"slices"
	"testing"

	"github.com/eclipse/paho.mqtt.golang/packets"
)

func TestGetReturnsACopyOfAPublish(t *testing.T) {
	s := New()
	s.Open()
	defer s.Close()
	p := packets.NewControlPacket(packets.Publish).(*packets.PublishPacket)
	p.Qos, p.MessageID, p.TopicName, p.Payload = 1, 7, "a/b", []byte("x")
	s.Put("o.7", p)

	got := s.Get("o.7").(*packets.PublishPacket)
	if got == p {
		t.Fatal("Get returned the stored packet itself; want a copy")
	}
	got.Dup = true
	if p.Dup {
		t.Error("setting Dup on the copy changed the stored packet")
	}
	if got.TopicName != "a/b" || got.MessageID != 7 || string(got.Payload) != "x" {
		t.Errorf("copy = %+v; want the stored packet's content", got)
	}
	if s.Get("o.8") != nil {
		t.Error("Get of a missing key = non-nil")
	}
	sub := packets.NewControlPacket(packets.Subscribe)
	s.Put("o.9", sub)
	if s.Get("o.9") != sub {
		t.Error("non-PUBLISH packets are returned as stored")
	}
}

func TestNotResentLeavesOutChosenPublishes(t *testing.T) {
	s := New().NotResent(func(topic string) bool { return topic == "b/state" })
	s.Open()
	defer s.Close()
	pub := func(id uint16, topic string) *packets.PublishPacket {
		p := packets.NewControlPacket(packets.Publish).(*packets.PublishPacket)
		p.Qos, p.MessageID, p.TopicName = 1, id, topic
		return p
	}
	s.Put("o.1", pub(1, "b/state"))
	s.Put("o.2", pub(2, "d/replies"))
	s.Put("i.3", pub(3, "b/state")) // incoming: paho's to acknowledge, not ours to drop
	got := s.All()
	slices.Sort(got)
	if want := []string{"i.3", "o.2"}; !slices.Equal(got, want) {
		t.Fatalf("All = %v; want %v", got, want)
	}
	if s.Get("o.1") != nil {
		t.Error("the state PUBLISH left out of All is still stored")
	}
	if p := s.Get("o.2"); p == nil || p.(*packets.PublishPacket).TopicName != "d/replies" {
		t.Errorf("Get(o.2) = %v; want the reply kept", p)
	}
}
